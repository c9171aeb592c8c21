//! The kernel the VMs boot: an unpacked Debian kernel package in the cache
//! of `tests/rig/prereqs.sh`. Found without checking prerequisites, so the
//! prerequisite check can look for it.

use std::cmp::Ordering;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

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
