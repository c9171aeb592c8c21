//! A real kernel in a real VM: boots Debian's stock `linux-image-*-amd64`
//! kernel (where `macvlan` is a loadable module) under
//! `qemu-system-x86_64` with a small initramfs that holds only what the test
//! puts there, runs the test's shell script as the guest's init, and returns
//! the serial console.
//!
//! ```ignore
//! let kernel = vm::kernel()?;                        // fails when a prerequisite is missing
//! let mut image = vm::Initramfs::new(&kernel)?;      // busybox, kmod, os-release
//! image.add_modules(&["macvlan"])?;                   // + deps, depmod'ed in the image
//! image.add_binary(Path::new("/usr/sbin/ip"), "/usr/bin/ip")?; // + its shared libs
//! image.set_init(r#"
//!     hna release "$(uname -r)"
//!     hna_run load modprobe macvlan
//! "#);
//! let run = vm::boot(&kernel, &image.build()?, &vm::VmOptions::default())?;
//! assert_eq!(run.marker("load.rc").as_deref(), Some("0"));
//! ```
//!
//! Marker protocol: the guest prints lines `@@HNA <key> <value>` on the
//! console (the script can use the shell helpers `hna KEY VALUE...` and
//! `hna_run KEY CMD ARGS...`, which reports every output line of the command
//! as `KEY.out` and its exit status as `KEY.rc`); [`VmRun::markers`] and
//! [`VmRun::marker`] read them back. The harness itself prints `@@HNA-EXIT
//! <status>` when the script ends and `@@HNA-END` just before powering off.
//!
//! The guest: `/init` mounts proc, sysfs, devtmpfs, devpts, debugfs, tmpfs on
//! `/run` and `/tmp`, brings `lo` up and runs the script (`/hna/test.sh`,
//! under busybox `sh`, `PATH=/usr/sbin:/usr/bin`, usr-merged like Debian 12).
//! The kernel's own `modprobe` helper is `/sbin/modprobe` (kmod), so
//! `request_module` works in the guest as on a real node. No network device
//! at all.
//!
//! Acceleration: software emulation (`-accel tcg -cpu max`; boot, a short
//! script and power-off take about 9 s on these 2-core machines) because
//! KVM fails here (nested: `-cpu max`/`host` abort on MSR 0x10a, other CPU
//! models hang right after SeaBIOS). `HNA_VM_ACCEL` and `HNA_VM_CPU`
//! override the accelerator and CPU model.
//!
//! Prerequisites ([`PREREQUISITES`]; `sudo tests/rig/prereqs.sh` installs
//! them): root, `qemu-system-x86_64`, `kmod`, `cpio`, `busybox`, `strip`,
//! and the unpacked kernel package in
//! `${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}/kernel/<package
//! version>/` (`boot/vmlinuz-<release>`, `lib/modules/<release>/` with
//! `modules.dep`, `VERSION` holding `<release>`); the newest such folder is
//! used, or the folder named by `HNA_VM_KERNEL_DIR`. When one is missing,
//! [`kernel`] fails naming it and its install command.

pub mod image;
mod initramfs;
mod qemu;
pub mod qga;

use std::cmp::Ordering;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

pub use crate::find_program;
use crate::prereq::{INSTALL_ALL, Prereq, require};
pub use initramfs::Initramfs;
pub use qemu::{VmOptions, VmRun, boot};

/// What booting a VM needs from the machine.
pub const PREREQUISITES: &[Prereq] = &[Prereq::Root, Prereq::Qemu, Prereq::VmKernel];

/// Default cache folder of `tests/rig/prereqs.sh`.
pub const DEFAULT_CACHE_DIR: &str = "/var/cache/harvester-node-agent";

/// A kernel to boot: an unpacked Debian kernel package.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// The kernel release (`uname -r` in the guest), e.g. `6.1.0-56-amd64`.
    pub release: String,
    /// The kernel image.
    pub vmlinuz: PathBuf,
    /// The folder holding `lib/modules/<release>/` (with `modules.dep`).
    pub modules_root: PathBuf,
}

impl Kernel {
    /// `<modules_root>/lib/modules/<release>`.
    pub fn modules_dir(&self) -> PathBuf {
        self.modules_root.join("lib/modules").join(&self.release)
    }

    /// Reads a kernel folder as `tests/rig/prereqs.sh` leaves it.
    pub fn from_dir(dir: &Path) -> Result<Kernel> {
        let version = dir.join("VERSION");
        let release = fs::read_to_string(&version)
            .with_context(|| format!("cannot read {}", version.display()))?
            .trim()
            .to_string();
        if release.is_empty() || release.contains('/') {
            bail!("{} holds no kernel release", version.display());
        }
        let kernel = Kernel {
            vmlinuz: dir.join("boot").join(format!("vmlinuz-{release}")),
            modules_root: dir.to_path_buf(),
            release,
        };
        for p in [&kernel.vmlinuz, &kernel.modules_dir().join("modules.dep")] {
            if !p.is_file() {
                bail!("{} is missing", p.display());
            }
        }
        Ok(kernel)
    }
}

/// The kernel to boot, after checking every prerequisite of the harness
/// ([`PREREQUISITES`]); a missing one is an error naming its install command.
pub fn kernel() -> Result<Kernel> {
    require(PREREQUISITES)?;
    find_kernel()
}

/// The unpacked kernel: the folder named by `HNA_VM_KERNEL_DIR`, else the
/// newest one in the cache of `tests/rig/prereqs.sh`.
pub fn find_kernel() -> Result<Kernel> {
    let dir = match std::env::var_os("HNA_VM_KERNEL_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let cache = std::env::var_os("HNA_CACHE_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_CACHE_DIR))
                .join("kernel");
            newest_kernel_dir(&cache)
                .with_context(|| format!("no unpacked kernel under {}", cache.display()))?
        }
    };
    Kernel::from_dir(&dir).with_context(|| format!("kernel folder {}", dir.display()))
}

/// The subfolder of `cache` with a `VERSION` file whose name is the highest
/// version (digit runs compared as numbers).
fn newest_kernel_dir(cache: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<(String, PathBuf)> = fs::read_dir(cache)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            (!name.starts_with('.') && path.join("VERSION").is_file()).then_some((name, path))
        })
        .collect();
    dirs.sort_by(|a, b| version_cmp(&a.0, &b.0));
    dirs.pop().map(|(_, path)| path)
}

/// Compares version strings, digit runs as numbers (`6.1.99-1 < 6.1.192-2`).
pub fn version_cmp(a: &str, b: &str) -> Ordering {
    fn chunks(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = s.as_bytes();
        for i in 1..=bytes.len() {
            if i == bytes.len() || bytes[i].is_ascii_digit() != bytes[start].is_ascii_digit() {
                out.push((bytes[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        out
    }
    let (ca, cb) = (chunks(a), chunks(b));
    for (x, y) in ca.iter().zip(cb.iter()) {
        let ord = match (x, y) {
            ((true, x), (true, y)) => {
                let (x, y) = (x.trim_start_matches('0'), y.trim_start_matches('0'));
                x.len().cmp(&y.len()).then_with(|| x.cmp(y))
            }
            ((_, x), (_, y)) => x.cmp(y),
        };
        if ord != Ordering::Equal {
            return ord;
        }
    }
    ca.len().cmp(&cb.len())
}

/// [`find_program`] or an error naming the program.
fn require_program(name: &str) -> Result<PathBuf> {
    find_program(name)
        .with_context(|| format!("`{name}` not found; install it with `{INSTALL_ALL}`"))
}

/// The agent binary under test without debug info (the debug build is
/// ~170 MB, which would make the initramfs slow to unpack under
/// emulation), written into `dir`.
pub fn stripped_binary(binary: &Path, dir: &Path) -> Result<PathBuf> {
    let out = dir.join(binary.file_name().context("binary has a file name")?);
    let st = std::process::Command::new("strip")
        .arg("-o")
        .arg(&out)
        .arg(binary)
        .status()
        .context("running strip (binutils)")?;
    if !st.success() {
        bail!("strip {} failed: {st}", binary.display());
    }
    Ok(out)
}
