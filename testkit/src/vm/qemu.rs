//! Booting the kernel and initramfs under qemu, and reading the console.

use std::fs::{self, File};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::{Kernel, require_program};

/// Prefix of a marker line: `@@HNA <key> <value>`.
pub const MARKER: &str = "@@HNA ";
/// Printed by `/init` after the script, with the script's exit status.
pub const EXIT_MARKER: &str = "@@HNA-EXIT";
/// Printed by `/init` just before powering off.
pub const END_MARKER: &str = "@@HNA-END";

/// How to run the VM.
#[derive(Debug, Clone)]
pub struct VmOptions {
    /// Guest memory (MiB).
    pub memory_mb: u32,
    /// The whole run, boot to power-off; qemu is killed after it.
    pub timeout: Duration,
    /// Extra qemu arguments (virtio-serial devices and chardevs, …).
    pub extra_args: Vec<String>,
    /// Extra kernel command line.
    pub append: String,
    /// Run qemu in this network namespace (`ip netns exec`), so that a tap
    /// device of the namespace can be the guest's NIC.
    pub netns: Option<String>,
}

impl Default for VmOptions {
    /// 512 MiB, 240 s, nothing extra.
    fn default() -> Self {
        VmOptions {
            memory_mb: 512,
            timeout: Duration::from_secs(240),
            extra_args: Vec::new(),
            append: String::new(),
            netns: None,
        }
    }
}

/// A finished VM run.
#[derive(Debug, Clone)]
pub struct VmRun {
    /// The serial console, `\r` removed.
    pub console: String,
    /// Wall time from starting qemu to its exit.
    pub duration: Duration,
    /// Whether the guest got to `@@HNA-END` (the script ran to its end).
    pub completed: bool,
}

impl VmRun {
    /// The JSON a command printed under `hna_run KEY`, reassembled from its
    /// `KEY.out` markers; panics with the console tail when it is not JSON.
    pub fn json(&self, key: &str) -> serde_json::Value {
        let text = self.markers(&format!("{key}.out")).join("\n");
        serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!(
                "{key}: not JSON ({e}): {text:?}\nconsole tail:\n{}",
                self.tail(80)
            )
        })
    }

    /// The check named `name` in `check --output json` printed under `KEY`.
    pub fn check(&self, key: &str, name: &str) -> serde_json::Value {
        self.json(key)["checks"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == name).cloned())
            .unwrap_or_else(|| panic!("{key}: no {name} check"))
    }

    /// The value of every marker line `@@HNA <key> <value>` with this key,
    /// in order (`""` for a marker without value). A marker is found
    /// anywhere in a line, so kernel messages that land in front of it on
    /// the console do not hide it.
    pub fn markers(&self, key: &str) -> Vec<String> {
        self.console
            .lines()
            .filter_map(|line| {
                let at = line.find(MARKER)?;
                let rest = &line[at + MARKER.len()..];
                let (k, value) = rest.split_once(' ').unwrap_or((rest, ""));
                (k == key).then(|| value.trim_end().to_string())
            })
            .collect()
    }

    /// The first marker with this key.
    pub fn marker(&self, key: &str) -> Option<String> {
        self.markers(key).into_iter().next()
    }

    /// The exit status of the test's script (`@@HNA-EXIT <status>`).
    pub fn script_status(&self) -> Option<i32> {
        self.console.lines().find_map(|line| {
            let at = line.find(EXIT_MARKER)?;
            line[at + EXIT_MARKER.len()..].trim().parse().ok()
        })
    }

    /// The last `n` lines of the console.
    pub fn tail(&self, n: usize) -> String {
        let lines: Vec<&str> = self.console.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// Kills and reaps qemu however the run ends.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Boots `kernel` with `initramfs` and waits for the guest to power off.
/// No network device at all; console on the first serial port. An error
/// (with the end of the console) when qemu fails, the guest does not reach
/// `@@HNA-END`, or the timeout passes.
///
/// One VM at a time per process: each guest under TCG keeps a core busy, and
/// two at once beside the rest of the suite on a 2-core machine slowed a
/// guest past its timeout. The wait for the turn does not count against
/// `opts.timeout`.
pub fn boot(kernel: &Kernel, initramfs: &Path, opts: &VmOptions) -> Result<VmRun> {
    let _turn = super::turn();
    let qemu = require_program("qemu-system-x86_64")?;
    for p in [kernel.vmlinuz.as_path(), initramfs] {
        if p.to_string_lossy().contains(',') {
            bail!("qemu cannot take a path with a comma: {}", p.display());
        }
    }
    let dir = tempfile::Builder::new().prefix("hna-vm-run-").tempdir()?;
    let console_path = dir.path().join("console.log");
    let qemu_log = dir.path().join("qemu.log");
    let append = format!("console=ttyS0 panic=-1 quiet loglevel=3 {}", opts.append);

    let log = File::create(&qemu_log)?;
    let mut cmd = match &opts.netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&qemu);
            c
        }
        None => Command::new(&qemu),
    };
    cmd.args(machine_args(opts.memory_mb))
        .args(["-monitor", "none"])
        .arg("-serial")
        .arg(format!("file:{}", console_path.display()))
        .args(["-nic", "none"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", append.trim_end()])
        .args(&opts.extra_args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    die_with_parent(&mut cmd);
    let start = Instant::now();
    let mut child = Qemu(
        cmd.spawn()
            .with_context(|| format!("cannot start {}", qemu.display()))?,
    );

    let read_console = || {
        fs::read(&console_path)
            .map(|b| String::from_utf8_lossy(&b).replace('\r', ""))
            .unwrap_or_default()
    };
    let mut ended_at: Option<Instant> = None;
    let mut last_check = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait()? {
            break Some(status);
        }
        if start.elapsed() > opts.timeout {
            break None;
        }
        // After @@HNA-END the guest powers off at once; give it a little
        // while, then stop qemu ourselves.
        if let Some(at) = ended_at {
            if at.elapsed() > Duration::from_secs(15) {
                let _ = child.0.kill();
                break child.0.wait().ok();
            }
        } else if last_check.elapsed() > Duration::from_millis(500) {
            last_check = Instant::now();
            if read_console().contains(END_MARKER) {
                ended_at = Some(Instant::now());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let duration = start.elapsed();
    drop(child);
    let run = VmRun {
        console: read_console(),
        duration,
        completed: false,
    };
    let run = VmRun {
        completed: run.console.lines().any(|l| l.contains(END_MARKER)),
        ..run
    };
    let qemu_out = fs::read_to_string(&qemu_log).unwrap_or_default();
    match status {
        None => bail!(
            "the VM did not finish within {:?}; console tail:\n{}\nqemu: {}",
            opts.timeout,
            run.tail(40),
            qemu_out.trim()
        ),
        Some(status) if !run.completed => bail!(
            "the VM stopped ({status}) before the script ended (no {END_MARKER}); console tail:\n{}\nqemu: {}",
            run.tail(40),
            qemu_out.trim()
        ),
        Some(status) if !status.success() && ended_at.is_none() => bail!(
            "qemu failed ({status}): {}\nconsole tail:\n{}",
            qemu_out.trim(),
            run.tail(40)
        ),
        Some(_) => Ok(run),
    }
}

/// The machine every test VM is: the accelerator and CPU model
/// (`HNA_VM_ACCEL`, default `tcg`; `HNA_VM_CPU`, default `max`), one vCPU,
/// `memory_mb` of RAM, no display, no default devices, no reboot.
pub(crate) fn machine_args(memory_mb: u32) -> Vec<String> {
    let accel = std::env::var("HNA_VM_ACCEL").unwrap_or_else(|_| "tcg".to_string());
    let cpu = std::env::var("HNA_VM_CPU").unwrap_or_else(|_| "max".to_string());
    [
        "-accel",
        &accel,
        "-cpu",
        &cpu,
        "-smp",
        "1",
        "-m",
        &memory_mb.to_string(),
        "-nographic",
        "-nodefaults",
        "-no-reboot",
    ]
    .map(str::to_string)
    .to_vec()
}

/// qemu gets SIGKILL when the test process dies, so no VM outlives a
/// crashed test. Kept across `exec` (also through `ip netns exec`).
pub(crate) fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork
    // and exec.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)
        });
    }
}
