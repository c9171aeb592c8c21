//! The guest's initramfs, staged in a temporary folder and packed with
//! `cpio -o -H newc`.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use super::{Kernel, require_program};

/// kmod's tools, in Debian's places (busybox's applets of the same names are
/// left out of the image).
const KMOD_TOOLS: [&str; 6] = [
    "/usr/sbin/modprobe",
    "/usr/sbin/insmod",
    "/usr/sbin/rmmod",
    "/usr/sbin/depmod",
    "/usr/sbin/modinfo",
    "/usr/bin/lsmod",
];

/// Busybox applets not linked: init is ours, kmod's tools are kmod's.
const SKIPPED_APPLETS: [&str; 8] = [
    "init", "linuxrc", "modprobe", "insmod", "rmmod", "depmod", "modinfo", "lsmod",
];

const OS_RELEASE: &str = r#"PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
NAME="Debian GNU/Linux"
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
ID=debian
HOME_URL="https://www.debian.org/"
VARIANT="harvester-node-agent test VM"
VARIANT_ID=hna-test-vm
"#;

/// Mounts, `lo` up; runs before the test's script.
const PROLOGUE: &str = r#"#!/bin/sh
# /init of a harvester-node-agent test VM (tests/vm).
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=dumb
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || true
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
ip link set lo up
echo "@@HNA-BEGIN $(cut -d' ' -f1 /proc/uptime)"
"#;

/// Reports the script's status, powers off; runs after the test's script.
const EPILOGUE: &str = r#"
echo "@@HNA-EXIT $hna_status"
echo "@@HNA-END"
sync
poweroff -f
sleep 30
"#;

/// Shell helpers put in front of the test's script.
const HELPERS: &str = r#"# helpers of tests/vm
# hna KEY VALUE...: one marker line.
hna() { hna_k=$1; shift; echo "@@HNA $hna_k $*"; }
# hna_run KEY CMD ARGS...: runs CMD, reports each line of its output (stdout
# and stderr) as KEY.out and its exit status as KEY.rc; returns that status.
hna_run() {
  hna_k=$1; shift
  "$@" >/tmp/.hna_run 2>&1
  hna_r=$?
  while IFS= read -r hna_l || [ -n "$hna_l" ]; do echo "@@HNA $hna_k.out $hna_l"; done </tmp/.hna_run
  echo "@@HNA $hna_k.rc $hna_r"
  return $hna_r
}
# end of helpers
"#;

/// An initramfs under construction. The staging folder is removed when this
/// is dropped.
pub struct Initramfs {
    dir: tempfile::TempDir,
    root: PathBuf,
    release: String,
    modules_src: PathBuf,
    script: String,
}

impl Initramfs {
    /// The base image: usr-merged layout, busybox with its applets, kmod
    /// with its tools, `/etc/os-release` (Debian 12), `/dev/console`, and
    /// `lib/modules/<release>/` with the kernel's `modules.builtin*` and
    /// `modules.order` (no modules until [`Initramfs::add_modules`]).
    pub fn new(kernel: &Kernel) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("hna-vm-")
            .tempdir()
            .context("cannot create the initramfs staging folder")?;
        let root = dir.path().join("root");
        let mut this = Initramfs {
            root,
            dir,
            release: kernel.release.clone(),
            modules_src: kernel.modules_dir(),
            script: String::new(),
        };
        let root = this.root.clone();
        for d in ["usr/bin", "usr/sbin", "usr/lib", "usr/lib64"] {
            fs::create_dir_all(root.join(d))?;
        }
        for (link, target) in [
            ("bin", "usr/bin"),
            ("sbin", "usr/sbin"),
            ("lib", "usr/lib"),
            ("lib64", "usr/lib64"),
        ] {
            symlink(target, root.join(link))?;
        }
        for d in [
            "proc",
            "sys",
            "dev",
            "run",
            "tmp",
            "root",
            "mnt",
            "hna",
            "etc/modprobe.d",
            "var/lib",
            "var/tmp",
        ] {
            fs::create_dir_all(root.join(d))?;
        }
        symlink("../run", root.join("var/run"))?;
        fs::set_permissions(root.join("tmp"), fs::Permissions::from_mode(0o1777))?;
        fs::set_permissions(root.join("root"), fs::Permissions::from_mode(0o700))?;
        nix::sys::stat::mknod(
            &root.join("dev/console"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            nix::sys::stat::makedev(5, 1),
        )
        .context("cannot create /dev/console in the initramfs")?;

        let busybox = require_program("busybox")?;
        this.add_binary(&busybox, "/usr/bin/busybox")?;
        let list = run(Command::new(&busybox).arg("--list"))?;
        for applet in list.lines().map(str::trim).filter(|a| !a.is_empty()) {
            if SKIPPED_APPLETS.contains(&applet) || applet.contains('/') || applet == "busybox" {
                continue;
            }
            symlink("busybox", root.join("usr/bin").join(applet))?;
        }
        this.add_binary(&require_program("kmod")?, "/usr/bin/kmod")?;
        for tool in KMOD_TOOLS {
            let target = if tool.starts_with("/usr/bin/") {
                "kmod"
            } else {
                "../bin/kmod"
            };
            symlink(target, this.dest(tool)?)?;
        }

        this.add_file("/etc/os-release", OS_RELEASE.as_bytes(), 0o644)?;
        this.add_file("/etc/hostname", b"hna-vm\n", 0o644)?;
        this.add_file("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644)?;
        this.add_file("/etc/group", b"root:x:0:\n", 0o644)?;
        this.add_file(
            "/etc/nsswitch.conf",
            b"passwd: files\ngroup: files\nhosts: files\n",
            0o644,
        )?;
        this.add_file("/etc/hosts", b"127.0.0.1 localhost hna-vm\n", 0o644)?;

        let modules = this.modules_dir();
        fs::create_dir_all(&modules)?;
        for f in [
            "modules.builtin",
            "modules.builtin.modinfo",
            "modules.order",
        ] {
            let src = this.modules_src.join(f);
            fs::copy(&src, modules.join(f))
                .with_context(|| format!("cannot copy {}", src.display()))?;
        }
        Ok(this)
    }

    /// The staging folder (the future `/`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Copies the host's executable `host` to `dest` in the image, replacing
    /// what is there, with every shared library `ldd` lists (and the ELF
    /// interpreter) at the same paths as on the host.
    pub fn add_binary(&mut self, host: &Path, dest: &str) -> Result<()> {
        let real =
            fs::canonicalize(host).with_context(|| format!("cannot find {}", host.display()))?;
        self.copy_in(&real, dest, 0o755)?;
        for lib in shared_libraries(&real)? {
            let path = lib.to_string_lossy().into_owned();
            if fs::symlink_metadata(self.dest(&path)?).is_ok() {
                continue;
            }
            let real_lib = fs::canonicalize(&lib)
                .with_context(|| format!("cannot find library {}", lib.display()))?;
            self.copy_in(&real_lib, &path, 0o755)?;
        }
        Ok(())
    }

    /// Writes a file at `dest` in the image (parent folders are created,
    /// what is there is replaced).
    pub fn add_file(&mut self, dest: &str, contents: &[u8], mode: u32) -> Result<()> {
        let path = self.prepare_dest(dest)?;
        fs::write(&path, contents).with_context(|| format!("cannot write {}", path.display()))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
        Ok(())
    }

    /// Copies the named modules (`macvlan`, `veth`, …) and the modules they
    /// depend on (per the kernel's `modules.dep`) under
    /// `/lib/modules/<release>/`, at their paths relative to that folder.
    /// Names built into the kernel are accepted and need nothing. `depmod`
    /// runs over the image in [`Initramfs::build`].
    pub fn add_modules(&mut self, names: &[&str]) -> Result<()> {
        let dep_file = self.modules_src.join("modules.dep");
        let deps = fs::read_to_string(&dep_file)
            .with_context(|| format!("cannot read {}", dep_file.display()))?;
        let mut by_name: HashMap<String, (String, Vec<String>)> = HashMap::new();
        for line in deps.lines() {
            let Some((module, rest)) = line.split_once(':') else {
                continue;
            };
            let requires = rest.split_whitespace().map(str::to_string).collect();
            by_name.insert(module_name(module), (module.to_string(), requires));
        }
        let builtin =
            fs::read_to_string(self.modules_src.join("modules.builtin")).unwrap_or_default();
        let builtin: BTreeSet<String> = builtin.lines().map(module_name).collect();

        let mut files = BTreeSet::new();
        for name in names {
            let name = module_name(name);
            match by_name.get(&name) {
                Some((file, requires)) => {
                    files.insert(file.clone());
                    files.extend(requires.iter().cloned());
                }
                None if builtin.contains(&name) => {}
                None => bail!(
                    "module {name} is neither in {} nor built into {}",
                    dep_file.display(),
                    self.release
                ),
            }
        }
        let modules = self.modules_dir();
        for file in files {
            if Path::new(&file)
                .components()
                .any(|c| !matches!(c, Component::Normal(_)))
            {
                bail!("unexpected module path {file} in modules.dep");
            }
            let dest = modules.join(&file);
            fs::create_dir_all(dest.parent().expect("module path has a parent"))?;
            fs::copy(self.modules_src.join(&file), &dest)
                .with_context(|| format!("cannot copy module {file}"))?;
        }
        Ok(())
    }

    /// The test's script: `/hna/test.sh`, run by `/init` after the prologue
    /// (mounts, `lo` up) and followed by the epilogue (`@@HNA-EXIT <status>`,
    /// `@@HNA-END`, `poweroff -f`). The helpers `hna` and `hna_run` are
    /// defined in it.
    pub fn set_init(&mut self, script: &str) {
        self.script = script.to_string();
    }

    /// Runs `depmod` over the image and packs it (`cpio -o -H newc`,
    /// uncompressed). Returns the path of the archive (inside the staging
    /// folder, valid while `self` lives).
    pub fn build(&self) -> Result<PathBuf> {
        let test = format!("#!/bin/sh\n{HELPERS}\n{}\n", self.script);
        write_mode(&self.root.join("hna/test.sh"), test.as_bytes(), 0o755)?;
        let init = format!("{PROLOGUE}\n/bin/sh /hna/test.sh\nhna_status=$?\n{EPILOGUE}");
        write_mode(&self.root.join("init"), init.as_bytes(), 0o755)?;

        run(Command::new(require_program("depmod")?)
            .arg("-b")
            .arg(&self.root)
            .arg(&self.release))?;

        let out = self.dir.path().join("initramfs.cpio");
        let cpio = require_program("cpio")?;
        let script = "cd \"$1\" && find . -mindepth 1 -print0 | \"$2\" --null -o -H newc -R 0:0 --quiet > \"$3\"";
        run(Command::new("/bin/sh")
            .args(["-c", script, "sh"])
            .arg(&self.root)
            .arg(&cpio)
            .arg(&out))
        .context("cannot pack the initramfs")?;
        Ok(out)
    }

    fn modules_dir(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }

    /// The staging path of the absolute image path `dest`.
    fn dest(&self, dest: &str) -> Result<PathBuf> {
        let rel = dest
            .strip_prefix('/')
            .with_context(|| format!("image path {dest:?} is not absolute"))?;
        if rel.is_empty()
            || Path::new(rel)
                .components()
                .any(|c| !matches!(c, Component::Normal(_)))
        {
            bail!("image path {dest:?} must name a file without `..`");
        }
        Ok(self.root.join(rel))
    }

    /// [`Self::dest`], with the parent folders created and whatever is at
    /// the path (a busybox applet link, say) removed.
    fn prepare_dest(&self, dest: &str) -> Result<PathBuf> {
        let path = self.dest(dest)?;
        fs::create_dir_all(path.parent().expect("image path has a parent"))
            .with_context(|| format!("cannot create the folder of {dest}"))?;
        if let Ok(meta) = fs::symlink_metadata(&path) {
            if meta.is_dir() {
                bail!("image path {dest} is a folder");
            }
            fs::remove_file(&path)?;
        }
        Ok(path)
    }

    fn copy_in(&self, host: &Path, dest: &str, mode: u32) -> Result<()> {
        let path = self.prepare_dest(dest)?;
        fs::copy(host, &path)
            .with_context(|| format!("cannot copy {} to {dest}", host.display()))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
        Ok(())
    }
}

/// `macvlan`, `kernel/drivers/net/macvlan.ko`, `nf-nat.ko.xz` → the module
/// name as the kernel spells it (`-` becomes `_`).
fn module_name(s: &str) -> String {
    let base = s.rsplit('/').next().unwrap_or(s);
    let base = [".ko.xz", ".ko.zst", ".ko.gz", ".ko"]
        .iter()
        .find_map(|ext| base.strip_suffix(ext))
        .unwrap_or(base);
    base.replace('-', "_")
}

/// The shared libraries `ldd` lists for `binary`, the ELF interpreter
/// included; empty for a static binary.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new(require_program("ldd")?)
        .arg(binary)
        .stdin(Stdio::null())
        .output()
        .context("cannot run ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let all = format!("{text}{}", String::from_utf8_lossy(&out.stderr));
        if all.contains("not a dynamic executable") || all.contains("statically linked") {
            return Ok(Vec::new());
        }
        bail!("ldd {} failed: {}", binary.display(), all.trim());
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)",
        // "/lib64/ld-linux-x86-64.so.2 (0x…)", "linux-vdso.so.1 (0x…)".
        let line = line.trim();
        let path = match line.split_once("=>") {
            Some((name, rest)) => {
                let path = rest.split_whitespace().next().unwrap_or("");
                if path == "not" {
                    bail!(
                        "ldd {}: library {} not found",
                        binary.display(),
                        name.trim()
                    );
                }
                path
            }
            None => line.split_whitespace().next().unwrap_or(""),
        };
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    Ok(libs)
}

fn write_mode(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    fs::write(path, contents).with_context(|| format!("cannot write {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Runs `cmd`, returns its stdout; a failure quotes the command and stderr.
fn run(cmd: &mut Command) -> Result<String> {
    let desc = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {desc}"))?;
    if !out.status.success() {
        bail!(
            "{desc} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
