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
//! [`kernel()`] fails naming it and its install command.

mod initramfs;
pub mod machine;
pub mod node;
mod qemu;
pub mod qga;
pub mod qmp;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

pub use crate::find_program;
pub use crate::locate::kernel::{DEFAULT_CACHE_DIR, Kernel, find_kernel, version_cmp};
pub use crate::locate::{image, kernel};
use crate::prereq::{INSTALL_ALL, Prereq, require};
pub use initramfs::Initramfs;
pub use qemu::{VmOptions, VmRun, boot};

/// What booting a VM needs from the machine.
pub const PREREQUISITES: &[Prereq] = &[Prereq::Root, Prereq::Qemu, Prereq::VmKernel];

/// The kernel to boot, after checking every prerequisite of the harness
/// ([`PREREQUISITES`]); a missing one is an error naming its install command.
pub fn kernel() -> Result<Kernel> {
    require(PREREQUISITES)?;
    find_kernel()
}

/// The VM turn of this process: one test's VMs at a time ([`boot`],
/// [`machine::Machine::boot`], and the VM nodes a test holds the turn
/// for). Under TCG a running guest keeps a core busy, and these machines
/// have two; two tests' guests at once beside the rest of the suite
/// slowed a guest past its timeout. A test that panicked while holding
/// the turn does not poison it.
pub fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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
