//! `kiwi/`: the image descriptions, checked by kiwi itself (`kiwi-ng image
//! info`, which validates the description against kiwi's RelaxNG schema and
//! its schematron rules without touching a repository), for every profile;
//! plus what the descriptions must say: the full kernel (macvlan.ko) instead
//! of `kernel-default-base`, and the services `config.sh` enables.
//!
//! Building the Debian disk image is not a test (it takes longer than CI
//! should spend on it); kiwi/README.md has the command and how far it gets.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};
use hna_testkit::prereq::kiwi_ng;

use crate::harness::tests;

tests! {
    every_profile_validates_with_kiwi: Kiwi;
    kiwi_refuses_an_invalid_description: Kiwi;
    opensuse_installs_kernel_default_not_base;
    config_sh_enables_the_services;
    config_sh_enables_units_without_a_running_systemd: Root, SystemdAnalyze;
}

/// (description folder under `kiwi/`, profile, image name in its XML).
const PROFILES: &[(&str, &str, &str)] = &[
    ("opensuse", "Leap-15.6", "harvester-node-agent-Minimal-VM"),
    ("opensuse", "Tumbleweed", "harvester-node-agent-Minimal-VM"),
    ("debian", "disk", "harvester-node-agent-Debian-VM"),
    ("debian", "rootfs", "harvester-node-agent-Debian-VM"),
];

fn kiwi_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kiwi")
}

fn read(rel: &str) -> Result<String> {
    let p = kiwi_dir().join(rel);
    std::fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))
}

/// `kiwi-ng --profile PROFILE image info --description DIR`.
fn image_info(description: &Path, profile: &str) -> Result<std::process::Output> {
    Command::new(kiwi_ng())
        .args(["--profile", profile, "image", "info", "--description"])
        .arg(description)
        // kiwi's own temporary files (the XSLT-converted description).
        .env("TMPDIR", std::env::temp_dir())
        .output()
        .with_context(|| format!("run {}", kiwi_ng().display()))
}

fn every_profile_validates_with_kiwi() -> Result<()> {
    for (dir, profile, name) in PROFILES {
        let out = image_info(&kiwi_dir().join(dir), profile)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            out.status.success(),
            "kiwi refused kiwi/{dir} with profile {profile}:\n{stdout}{stderr}"
        );
        // It answers with the description it loaded (JSON after its log
        // lines, which all start with "[ "): the right file, and the profile
        // was really selected.
        let answer: String = stdout
            .lines()
            .filter(|l| !l.starts_with("[ "))
            .collect::<Vec<_>>()
            .join("\n");
        let info: serde_json::Value = serde_json::from_str(&answer)
            .with_context(|| format!("kiwi's answer for kiwi/{dir} is not JSON: {stdout}"))?;
        ensure!(
            info["image"] == *name,
            "kiwi/{dir}: image {} instead of {name}",
            info["image"]
        );
        ensure!(
            format!("{stdout}{stderr}").contains(&format!("Selected profiles: {profile}")),
            "kiwi/{dir}: profile {profile} not selected:\n{stdout}{stderr}"
        );
    }
    Ok(())
}

/// The control: the same call on a copy with one misspelt element fails,
/// naming the RelaxNG error, so a pass above is the schema's verdict.
fn kiwi_refuses_an_invalid_description() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let xml = read("opensuse/config.kiwi")?;
    let broken = xml.replacen(
        "<package name=\"qemu-guest-agent\"/>",
        "<pakage name=\"qemu-guest-agent\"/>",
        1,
    );
    ensure!(broken != xml, "control edit did not apply");
    std::fs::write(dir.path().join("config.kiwi"), broken)?;
    let out = image_info(dir.path(), "Leap-15.6")?;
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        !out.status.success(),
        "kiwi accepted a broken description:\n{all}"
    );
    ensure!(
        all.contains("RELAXNG") && all.contains("pakage"),
        "kiwi failed, but not on the schema:\n{all}"
    );
    Ok(())
}

/// The `<package name="..."/>` entries inside the `<packages type="KIND"...>`
/// sections of `xml`.
fn packages(xml: &str, kind: &str) -> Vec<String> {
    let open = format!("<packages type=\"{kind}\"");
    let mut names = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        let section = &rest[start..];
        let end = section.find("</packages>").unwrap_or(section.len());
        for line in section[..end].lines() {
            if let Some(tail) = line.trim().strip_prefix("<package name=\"")
                && let Some(name) = tail.split('"').next()
            {
                names.push(name.to_string());
            }
        }
        rest = &section[end..];
    }
    names
}

fn opensuse_installs_kernel_default_not_base() -> Result<()> {
    let xml = read("opensuse/config.kiwi")?;
    let image = packages(&xml, "image");
    for wanted in [
        "kernel-default",
        "qemu-guest-agent",
        "cloud-init",
        "harvester-node-agent",
    ] {
        ensure!(
            image.iter().any(|p| p == wanted),
            "opensuse image packages {image:?} lack {wanted}"
        );
    }
    ensure!(
        !image.iter().any(|p| p == "kernel-default-base"),
        "kernel-default-base (no macvlan.ko) is installed"
    );
    ensure!(
        packages(&xml, "delete").contains(&"kernel-default-base".to_string()),
        "kernel-default-base is not kept out (packages type=\"delete\")"
    );
    ensure!(
        xml.contains("macvlan"),
        "the description does not say why (macvlan)"
    );
    // Debian's disk profile carries the stock kernel, where macvlan is a
    // module.
    let debian = read("debian/config.kiwi")?;
    ensure!(
        packages(&debian, "image").contains(&"linux-image-amd64".to_string()),
        "kiwi/debian lacks linux-image-amd64"
    );
    Ok(())
}

/// `config.sh` (run by kiwi inside the image root, so not run here: it
/// edits /etc) enables qemu-guest-agent, cloud-init's units and the agent,
/// and is valid bash. kiwi/debian uses the same script.
fn config_sh_enables_the_services() -> Result<()> {
    let script = read("opensuse/config.sh")?;
    ensure!(
        read("debian/config.sh")? == script,
        "kiwi/debian/config.sh differs from kiwi/opensuse/config.sh"
    );
    let syntax = Command::new("bash")
        .arg("-n")
        .arg(kiwi_dir().join("opensuse/config.sh"))
        .output()
        .context("bash -n")?;
    ensure!(
        syntax.status.success(),
        "config.sh: {}",
        String::from_utf8_lossy(&syntax.stderr)
    );
    let enabled = enabled_units(&script);
    for unit in CLASSIC_UNITS {
        ensure!(
            enabled.iter().any(|u| u == unit),
            "config.sh does not enable {unit} (enables {enabled:?})"
        );
    }
    Ok(())
}

/// What config.sh enables with Leap's and Debian's (pre-24.3) cloud-init.
const CLASSIC_UNITS: &[&str] = &[
    "qemu-guest-agent.service",
    "cloud-init-local.service",
    "cloud-init.service",
    "cloud-config.service",
    "cloud-final.service",
    "harvester-node-agent.service",
];

/// The units named on `enable_if_present` calls (continued lines joined).
fn enabled_units(script: &str) -> Vec<String> {
    let joined = script.replace("\\\n", " ");
    joined
        .lines()
        .filter_map(|l| l.trim().strip_prefix("enable_if_present "))
        .flat_map(|args| args.split_whitespace().map(str::to_owned))
        .collect()
}

/// `config.sh` as kiwi runs it: no systemd manager to ask (kiwi's chroot;
/// here a private mount namespace, whose fresh /etc and unit folder hide
/// the host's). The real `systemctl` enables whatever unit files are
/// there, and the test reads the symlinks it made. Run once with
/// Leap/Debian's cloud-init units and the agent, once with Tumbleweed's
/// cloud-init 24.3+ units and no agent (kiwi/debian).
fn config_sh_enables_units_without_a_running_systemd() -> Result<()> {
    let script = kiwi_dir().join("opensuse/config.sh");
    for units in [
        CLASSIC_UNITS,
        &[
            "qemu-guest-agent.service",
            "cloud-init-main.service",
            "cloud-init-network.service",
            "cloud-config.service",
            "cloud-final.service",
        ][..],
    ] {
        let setup = format!(
            r#"set -eu
mount -t tmpfs hna-etc /etc
mount -t tmpfs hna-units /usr/lib/systemd/system
mount -t tmpfs hna-dbus /var/lib/dbus
mkdir -p /etc/systemd/system
echo 0123456789abcdef0123456789abcdef > /etc/machine-id
for u in {units}; do
  printf '[Unit]\nDescription=%s\n[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=multi-user.target\n' "$u" \
    > /usr/lib/systemd/system/$u
done
bash {script} >&2
echo "enabled: $(cd /etc/systemd/system/multi-user.target.wants && echo *)"
echo "modules: $(cat /etc/modules-load.d/harvester-node-agent.conf)"
echo "machine-id: $(wc -c < /etc/machine-id)"
"#,
            units = units.join(" "),
            script = script.display(),
        );
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "bash", "-c", &setup])
            .output()
            .context("unshare")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "config.sh with {units:?} failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let field = |name: &str| {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or_default()
                .to_string()
        };
        let mut enabled: Vec<String> = field("enabled:")
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        enabled.sort();
        let mut want: Vec<String> = units.iter().map(|u| u.to_string()).collect();
        want.sort();
        ensure!(enabled == want, "enabled {enabled:?}, want {want:?}");
        ensure!(field("modules:") == "macvlan", "modules-load.d: {stdout}");
        ensure!(
            field("machine-id:") == "0",
            "machine-id not emptied: {stdout}"
        );
    }
    Ok(())
}
