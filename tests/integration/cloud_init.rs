//! `packaging/cloud-init/cloud-config.yaml`, the user data that installs the
//! agent on first boot: it is `#cloud-config` YAML that installs
//! qemu-guest-agent and the agent (.deb and .rpm), enables and starts both
//! from `runcmd`, and cloud-init's own schema accepts it. (Booting it is the
//! image test's job.)

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use hna_testkit::serde_norway::{self, Value};

use crate::harness::tests;

tests! {
    is_cloud_config_installing_and_enabling_both_services;
    runcmd_install_is_idempotent_shell;
    cloud_init_schema_accepts_it: CloudInit;
}

fn cloud_config_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/cloud-init/cloud-config.yaml")
}

fn load() -> Result<(String, Value)> {
    let path = cloud_config_path();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let doc: Value =
        serde_norway::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
    Ok((text, doc))
}

/// The `runcmd` entries, each as the words it runs (a string entry is one
/// shell line, kept whole).
fn runcmd(doc: &Value) -> Result<Vec<Vec<String>>> {
    let Some(entries) = doc.get("runcmd").and_then(Value::as_sequence) else {
        bail!("no runcmd list");
    };
    entries
        .iter()
        .map(|e| match e {
            Value::String(line) => Ok(vec![line.clone()]),
            Value::Sequence(words) => words
                .iter()
                .map(|w| {
                    w.as_str()
                        .map(str::to_owned)
                        .with_context(|| format!("runcmd word {w:?} is not a string"))
                })
                .collect(),
            other => bail!("runcmd entry {other:?} is neither a string nor a list"),
        })
        .collect()
}

/// Whether `cmd` enables and starts `unit` (`systemctl enable --now`).
fn enables_now(cmd: &[String], unit: &str) -> bool {
    let words: Vec<&str> = cmd.iter().map(String::as_str).collect();
    words.first() == Some(&"systemctl")
        && words.contains(&"enable")
        && words.contains(&"--now")
        && words
            .iter()
            .any(|w| *w == unit || *w == unit.trim_end_matches(".service"))
}

fn is_cloud_config_installing_and_enabling_both_services() -> Result<()> {
    let (text, doc) = load()?;
    // cloud-init takes user data as cloud-config only with this exact
    // first line.
    ensure!(
        text.lines().next() == Some("#cloud-config"),
        "the first line must be `#cloud-config`, is {:?}",
        text.lines().next()
    );
    let packages: Vec<&str> = doc
        .get("packages")
        .and_then(Value::as_sequence)
        .context("no packages list")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    ensure!(
        packages.contains(&"qemu-guest-agent"),
        "packages {packages:?} lack qemu-guest-agent"
    );

    let cmds = runcmd(&doc)?;
    for unit in ["qemu-guest-agent.service", "harvester-node-agent.service"] {
        ensure!(
            cmds.iter().any(|c| enables_now(c, unit)),
            "no runcmd entry enables and starts {unit}: {cmds:#?}"
        );
    }
    // The agent is installed before it is enabled, for both package kinds.
    let install = cmds
        .iter()
        .position(|c| c.iter().any(|w| w.contains("AGENT_DEB_URL")))
        .context("no runcmd entry installs the agent's package")?;
    let enable = cmds
        .iter()
        .position(|c| enables_now(c, "harvester-node-agent.service"))
        .context("agent not enabled")?;
    ensure!(
        install < enable,
        "the agent is enabled before it is installed"
    );
    let script = cmds[install].join(" ");
    for needle in [
        "apt-get install -y \"$deb\"",
        "AGENT_RPM_URL",
        "zypper --non-interactive install",
    ] {
        ensure!(script.contains(needle), "install step lacks {needle:?}");
    }

    // The drop-in it writes lands where systemd reads drop-ins of the unit.
    let files = doc
        .get("write_files")
        .and_then(Value::as_sequence)
        .context("no write_files")?;
    let dropin = files
        .iter()
        .find_map(|f| f.get("path").and_then(Value::as_str))
        .context("write_files entry without path")?;
    ensure!(
        dropin.starts_with("/etc/systemd/system/harvester-node-agent.service.d/")
            && dropin.ends_with(".conf"),
        "write_files path {dropin}"
    );
    Ok(())
}

/// The install step, run twice against stand-ins for dpkg-query, apt-get
/// and curl on `$PATH`: the first run fetches and installs, the second
/// (the package now "installed") does neither. The script is the exact
/// text of the cloud-config.
fn runcmd_install_is_idempotent_shell() -> Result<()> {
    let (_, doc) = load()?;
    let cmds = runcmd(&doc)?;
    let step = cmds
        .iter()
        .find(|c| c.iter().any(|w| w.contains("AGENT_DEB_URL")))
        .context("no install step")?;
    ensure!(
        step.len() == 3 && step[0] == "sh" && step[1] == "-c",
        "install step is not `sh -c SCRIPT`: {step:?}"
    );
    let script = &step[2];

    let dir = tempfile::tempdir()?;
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin)?;
    let calls = dir.path().join("calls");
    let installed = dir.path().join("installed");
    let stub = |name: &str, body: &str| -> Result<()> {
        let p = bin.join(name);
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\necho \"{name} $*\" >> '{}'\n{body}\n",
                calls.display()
            ),
        )?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
        Ok(())
    };
    let installed_s = installed.display().to_string();
    stub(
        "dpkg-query",
        &format!("[ -e '{installed_s}' ] && printf 'install ok installed' || exit 1"),
    )?;
    stub("apt-get", &format!("touch '{installed_s}'"))?;
    // curl -fsSL --retry 5 -o FILE URL: write FILE.
    stub(
        "curl",
        "while [ $# -gt 1 ]; do [ \"$1\" = -o ] && { shift; : > \"$1\"; }; shift; done",
    )?;
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let run = || -> Result<()> {
        let out = Command::new("/bin/sh")
            .args(["-c", script])
            .env("PATH", &path)
            .output()
            .context("run the install step")?;
        ensure!(
            out.status.success(),
            "install step failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    };
    run()?;
    let first = std::fs::read_to_string(&calls)?;
    ensure!(
        first.contains("curl ")
            && first.contains("apt-get install -y /var/tmp/harvester-node-agent.deb"),
        "first run did not fetch and install: {first}"
    );
    ensure!(installed.exists(), "apt-get stand-in not run");
    run()?;
    let second = std::fs::read_to_string(&calls)?;
    let again = &second[first.len()..];
    ensure!(
        again.lines().all(|l| l.starts_with("dpkg-query ")),
        "second run did more than look: {again}"
    );
    Ok(())
}

fn cloud_init_schema(path: &Path) -> Result<std::process::Output> {
    Command::new("cloud-init")
        .args(["schema", "--config-file"])
        .arg(path)
        .output()
        .context("run `cloud-init schema`")
}

fn cloud_init_schema_accepts_it() -> Result<()> {
    let path = cloud_config_path();
    let out = cloud_init_schema(&path)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && stdout.contains("Valid cloud-config"),
        "cloud-init schema refused {}: {stdout}{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    // Control: the same check refuses a broken copy (a number where the
    // package list belongs), so the pass above means something.
    let (text, _) = load()?;
    let broken = text.replace(
        "packages:\n  - qemu-guest-agent\n  - curl\n",
        "packages: 5\n",
    );
    ensure!(broken != text, "control edit did not apply");
    let dir = tempfile::tempdir()?;
    let bad = dir.path().join("broken.yaml");
    std::fs::write(&bad, broken)?;
    let out = cloud_init_schema(&bad)?;
    ensure!(
        !out.status.success(),
        "cloud-init schema accepted a broken copy: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}
