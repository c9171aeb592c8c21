//! Booting the cached image ([`crate::locate::image`]): the NoCloud seed and qemu.
//! Apart from the image lookup, so that finding the image (which the
//! prerequisite check does) needs nothing that checks prerequisites.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::qga::Qga;
use super::require_program;
use crate::locate::image::{Image, run};

/// A NoCloud seed ISO (`cidata`) at `<dir>/<name>.iso` with `user-data`,
/// `meta-data` and `files` (name in the ISO, file on the host).
pub fn nocloud_seed(
    dir: &Path,
    name: &str,
    user_data: &str,
    meta_data: &str,
    files: &[(&str, &Path)],
) -> Result<PathBuf> {
    let staging = dir.join(format!("{name}.d"));
    fs::create_dir_all(&staging)?;
    fs::write(staging.join("user-data"), user_data)?;
    fs::write(staging.join("meta-data"), meta_data)?;
    for (to, from) in files {
        fs::copy(from, staging.join(to))
            .with_context(|| format!("copy {} into the seed", from.display()))?;
    }
    let iso = dir.join(format!("{name}.iso"));
    run(Command::new(require_program("genisoimage")?)
        .args(["-quiet", "-volid", "cidata", "-joliet", "-rock", "-output"])
        .arg(&iso)
        .arg(&staging))?;
    Ok(iso)
}

/// How to boot a [`Machine`].
#[derive(Debug, Clone)]
pub struct MachineOptions {
    pub memory_mb: u32,
    /// The root disk (a qcow2 overlay).
    pub disk: PathBuf,
    /// A NoCloud seed, attached as a read-only virtio disk.
    pub seed: Option<PathBuf>,
    /// A NIC: `(netns, tap name, mac)`; the tap is created in `netns` by
    /// the caller's choice of bridge ([`Machine::boot`] adds it to `br0`).
    pub nic: Option<(String, String, String)>,
}

/// A running VM; qemu is killed when it drops.
///
/// One at a time per process (the turn is held for the machine's life):
/// under TCG a guest keeps a core busy, and the machines here are 2-core.
pub struct Machine {
    child: Child,
    _turn: std::sync::MutexGuard<'static, ()>,
    pub console: PathBuf,
    pub qga_socket: PathBuf,
    qemu_log: PathBuf,
    pub started: Instant,
}

impl Machine {
    /// Boots `image`'s kernel and initrd with `opts.disk` as root under TCG,
    /// files in `dir`. Returns once qemu runs; see [`Machine::qga`] for the
    /// guest being up.
    pub fn boot(image: &Image, dir: &Path, opts: &MachineOptions) -> Result<Machine> {
        let turn = super::turn();
        let qemu = require_program("qemu-system-x86_64")?;
        let console = dir.join("console.log");
        let qga_socket = dir.join("qga.sock");
        let qemu_log = dir.join("qemu.log");
        for p in [&opts.disk, &console, &qga_socket] {
            if p.to_string_lossy().contains(',') {
                bail!("qemu cannot take a path with a comma: {}", p.display());
            }
        }
        let mut cmd = match &opts.nic {
            Some((ns, tap, _)) => {
                run(
                    Command::new("ip").args(["-n", ns, "tuntap", "add", "dev", tap, "mode", "tap"])
                )?;
                run(Command::new("ip").args(["-n", ns, "link", "set", tap, "master", "br0"]))?;
                run(Command::new("ip").args(["-n", ns, "link", "set", tap, "up"]))?;
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&qemu);
                c
            }
            None => Command::new(&qemu),
        };
        cmd.args(super::qemu::machine_args(opts.memory_mb))
            .args(["-monitor", "none"])
            .arg("-serial")
            .arg(format!("file:{}", console.display()))
            .arg("-kernel")
            .arg(&image.vmlinuz)
            .arg("-initrd")
            .arg(&image.initrd)
            .args([
                "-append",
                "root=/dev/vda rw console=ttyS0 panic=-1 net.ifnames=0",
            ])
            .arg("-drive")
            .arg(format!(
                "file={},if=virtio,format=qcow2,cache=unsafe",
                opts.disk.display()
            ));
        if let Some(seed) = &opts.seed {
            cmd.arg("-drive").arg(format!(
                "file={},if=virtio,format=raw,readonly=on",
                seed.display()
            ));
        }
        cmd.args(["-device", "virtio-serial-pci,id=vs0"])
            .arg("-chardev")
            .arg(format!(
                "socket,id=qga0,path={},server=on,wait=off",
                qga_socket.display()
            ))
            .args([
                "-device",
                "virtserialport,bus=vs0.0,chardev=qga0,name=org.qemu.guest_agent.0",
            ]);
        match &opts.nic {
            Some((_, tap, mac)) => {
                cmd.arg("-netdev")
                    .arg(format!("tap,id=n0,ifname={tap},script=no,downscript=no"))
                    .arg("-device")
                    .arg(format!("virtio-net-pci,netdev=n0,mac={mac}"));
            }
            None => {
                cmd.args(["-nic", "none"]);
            }
        }
        let log = fs::File::create(&qemu_log)?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        super::qemu::die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", qemu.display()))?;
        Ok(Machine {
            child,
            _turn: turn,
            console,
            qga_socket,
            qemu_log,
            started: Instant::now(),
        })
    }

    /// Connects to the guest's qemu-ga, waiting until it answers (the guest
    /// has booted to its qemu-guest-agent.service) or `timeout` after boot.
    pub fn qga(&mut self, timeout: Duration) -> Result<Qga> {
        let deadline = self.started + timeout;
        let qga = Qga::connect(&self.qga_socket, deadline);
        if let Some(st) = self.child.try_wait()? {
            bail!(
                "qemu exited ({st}): {}\nconsole tail:\n{}",
                fs::read_to_string(&self.qemu_log)
                    .unwrap_or_default()
                    .trim(),
                self.console_tail(60)
            );
        }
        qga.with_context(|| format!("console tail:\n{}", self.console_tail(60)))
    }

    /// The last `n` lines of the serial console.
    pub fn console_tail(&self, n: usize) -> String {
        let text = fs::read(&self.console)
            .map(|b| String::from_utf8_lossy(&b).replace('\r', ""))
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// What qemu itself printed.
    pub fn qemu_log(&self) -> String {
        fs::read_to_string(&self.qemu_log).unwrap_or_default()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
