//! A real Debian bookworm cloud image booted with systemd, cloud-init and
//! qemu-guest-agent, as a user's VM on Harvester boots it.
//!
//! `tests/rig/image.sh` builds the image once from Debian's repositories
//! (mmdebstrap) and caches it by a hash of its package list
//! ([`cached`] finds it); nothing here mounts anything:
//!
//! - [`Image::overlay`]: a qcow2 overlay per boot over the cached `disk.raw`,
//!   so the cache stays pristine;
//! - [`Image::variant_without`]: another raw disk made with `mkfs.ext4 -d`
//!   from a hard-linked copy of the cached rootfs minus some files (e.g.
//!   `macvlan.ko`, with `depmod` re-run on the host);
//! - `vm::machine::nocloud_seed`: a NoCloud seed ISO (label `cidata`) with `user-data`,
//!   `meta-data` and any other file (the agent's `.deb`);
//! - `vm::machine::Machine::boot`: qemu (TCG, direct kernel boot from the image's
//!   `/boot`, `root=/dev/vda`), the console in a file, a virtio-serial
//!   `org.qemu.guest_agent.0` channel whose host end is a socket
//!   (`Machine::qga`), and optionally a NIC on a tap device in a network
//!   namespace (qemu runs inside it).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The script that builds and caches the image.
pub fn image_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/rig/image.sh")
}

/// The built image: `tests/rig/image.sh`'s cache folder.
#[derive(Debug, Clone)]
pub struct Image {
    pub dir: PathBuf,
    /// The tree the disk was made from.
    pub rootfs: PathBuf,
    /// ext4 of `rootfs`, sparse raw.
    pub disk: PathBuf,
    pub vmlinuz: PathBuf,
    pub initrd: PathBuf,
    /// The kernel release (`uname -r` in the guest).
    pub release: String,
}

/// The folder `tests/rig/image.sh` uses for the current package list
/// (built or not).
pub fn cache_dir() -> Result<PathBuf> {
    let out = Command::new("bash")
        .arg(image_script())
        .arg("--print")
        .output()
        .context("running tests/rig/image.sh --print")?;
    if !out.status.success() {
        bail!(
            "tests/rig/image.sh --print failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let dir = text.lines().last().unwrap_or_default().trim();
    if dir.is_empty() {
        bail!("tests/rig/image.sh --print printed nothing");
    }
    Ok(PathBuf::from(dir))
}

/// The cached image of the current package list; an error naming the
/// command that builds it when it is not there.
pub fn cached() -> Result<Image> {
    let dir = cache_dir()?;
    if !dir.join("READY").is_file() {
        bail!(
            "no image at {} (build it with `sudo tests/rig/image.sh`, or `sudo tests/rig/prereqs.sh`)",
            dir.display()
        );
    }
    let release = fs::read_to_string(dir.join("RELEASE"))
        .context("reading the image's RELEASE")?
        .trim()
        .to_string();
    Ok(Image {
        rootfs: dir.join("rootfs"),
        disk: dir.join("disk.raw"),
        vmlinuz: dir.join("vmlinuz"),
        initrd: dir.join("initrd.img"),
        release,
        dir,
    })
}

/// Runs `cmd`, failing with its output when it fails.
pub(crate) fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Image {
    /// `<dir>/<name>.qcow2`, a copy-on-write overlay over `base` (the
    /// cached disk or a variant): the guest writes there, never to `base`.
    pub fn overlay(base: &Path, dir: &Path, name: &str) -> Result<PathBuf> {
        let out = dir.join(format!("{name}.qcow2"));
        run(Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(base)
            .arg(&out))?;
        Ok(out)
    }

    /// A raw disk at `<dir>/<name>.raw` holding the cached rootfs without
    /// `remove` (paths relative to the rootfs, e.g.
    /// `usr/lib/modules/<release>/kernel/drivers/net/macvlan.ko`), with the
    /// module indexes rebuilt by `depmod -b` on the host. The copy is hard
    /// links in a scratch folder beside the cache (depmod replaces its
    /// files by rename, and the removed paths are unlinked, so the cached
    /// tree is not changed); it is deleted afterwards.
    pub fn variant_without(&self, remove: &[&str], dir: &Path, name: &str) -> Result<PathBuf> {
        let scratch = tempfile::Builder::new()
            .prefix(".variant-")
            .tempdir_in(self.dir.parent().context("image dir has a parent")?)?;
        let tree = scratch.path().join("rootfs");
        run(Command::new("cp").arg("-al").arg(&self.rootfs).arg(&tree))?;
        for rel in remove {
            let p = tree.join(rel);
            fs::remove_file(&p).with_context(|| format!("remove {}", p.display()))?;
        }
        // Fresh index files, not the hard-linked ones.
        let mods = tree.join("usr/lib/modules").join(&self.release);
        for entry in fs::read_dir(&mods)? {
            let entry = entry?;
            if entry.file_name().to_string_lossy().starts_with("modules.") {
                let keep = [
                    "modules.order",
                    "modules.builtin",
                    "modules.builtin.modinfo",
                ];
                if !keep.contains(&entry.file_name().to_string_lossy().as_ref()) {
                    fs::remove_file(entry.path())?;
                }
            }
        }
        run(Command::new("depmod")
            .arg("-b")
            .arg(tree.join("usr"))
            .arg(&self.release))?;
        let size = fs::metadata(&self.disk)?.len();
        let out = dir.join(format!("{name}.raw"));
        fs::File::create(&out)?.set_len(size)?;
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "hna-root", "-d"])
            .arg(&tree)
            .arg(&out))?;
        Ok(out)
    }
}
