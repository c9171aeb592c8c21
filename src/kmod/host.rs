//! The real host behind [`super::KernelHost`]: files under /proc, /lib/modules
//! and modprobe.d, the system's `modprobe`, and a netlink probe in a private
//! network namespace.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use futures::TryStreamExt;
use rtnetlink::packet_route::link::MacVlanMode;
use rtnetlink::{LinkDummy, LinkMacVlan, LinkVeth};

use super::KernelHost;
use super::detect::{self, Facts};
use super::modprobe_d;
use super::remedy::OsRelease;

/// How long `modprobe` may take before the load counts as failed.
const MODPROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// The running system. `root` is `/` except in tests.
#[derive(Debug, Clone)]
pub struct Host {
    pub root: PathBuf,
}

impl Default for Host {
    fn default() -> Self {
        Host {
            root: PathBuf::from("/"),
        }
    }
}

impl Host {
    fn path(&self, p: &str) -> PathBuf {
        self.root.join(p.trim_start_matches('/'))
    }

    fn read(&self, p: &str) -> Option<String> {
        std::fs::read_to_string(self.path(p)).ok()
    }
}

fn uname_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().to_string())
        .unwrap_or_default()
}

/// Where modprobe lives on the distributions we ship to (and on PATH).
fn find_modprobe() -> Option<PathBuf> {
    let fixed = [
        "/usr/sbin/modprobe",
        "/sbin/modprobe",
        "/usr/bin/modprobe",
        "/bin/modprobe",
    ];
    fixed
        .iter()
        .map(PathBuf::from)
        .chain(
            std::env::var_os("PATH")
                .map(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join("modprobe"))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
        )
        .find(|p| p.is_file())
}

impl KernelHost for Host {
    fn facts(&self, module: &str) -> Facts {
        let release = uname_release();
        let modules_dir = ["lib/modules", "usr/lib/modules"]
            .iter()
            .map(|base| self.root.join(base).join(&release))
            .find(|p| p.is_dir());
        let read_index = |name: &str| {
            modules_dir
                .as_ref()
                .and_then(|d| std::fs::read_to_string(d.join(name)).ok())
        };
        let mut facts = Facts {
            proc_modules: self.read("/proc/modules"),
            modules_builtin: read_index("modules.builtin"),
            modules_dep: read_index("modules.dep"),
            modules_dir: modules_dir.clone(),
            release,
            existing_files: Vec::new(),
            blacklisted_by: Vec::new(),
        };
        facts.existing_files = detect::files_needed(&facts, module)
            .into_iter()
            .filter(|p| p.is_file())
            .collect();
        for file in modprobe_d::conf_files(modprobe_d::MODPROBE_D, &self.root) {
            if let Ok(text) = std::fs::read_to_string(&file) {
                facts
                    .blacklisted_by
                    .extend(modprobe_d::blacklist_lines(&file, &text, module));
            }
        }
        if let Some(cmdline) = self.read("/proc/cmdline") {
            facts
                .blacklisted_by
                .extend(modprobe_d::cmdline_blacklist(&cmdline, module));
        }
        facts
    }

    fn boot_persistence(&self, module: &str) -> Option<PathBuf> {
        let mut candidates = modprobe_d::conf_files(modprobe_d::MODULES_LOAD_D, &self.root);
        // Debian's /etc/modules is read by systemd-modules-load too.
        candidates.push(self.path("/etc/modules"));
        candidates.into_iter().find(|f| {
            std::fs::read_to_string(f).is_ok_and(|t| modprobe_d::lists_module(&t, module))
        })
    }

    fn os_release(&self) -> OsRelease {
        self.read("/etc/os-release")
            .or_else(|| self.read("/usr/lib/os-release"))
            .map(|t| OsRelease::parse(&t))
            .unwrap_or_default()
    }

    fn load(&self, module: &str) -> Result<(), String> {
        let Some(modprobe) = find_modprobe() else {
            return Err(
                "modprobe is not installed (package kmod); install it or load the module with insmod".into(),
            );
        };
        let mut child = Command::new(&modprobe)
            .arg("--quiet")
            .arg("--")
            .arg(module)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", modprobe.display()))?;
        let deadline = std::time::Instant::now() + MODPROBE_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    let mut stderr = String::new();
                    if let Some(mut e) = child.stderr.take() {
                        use std::io::Read;
                        let _ = e.read_to_string(&mut stderr);
                    }
                    return if status.success() {
                        Ok(())
                    } else {
                        Err(format!(
                            "`{} {module}` failed ({status}): {}",
                            modprobe.display(),
                            stderr.trim()
                        ))
                    };
                }
                Ok(None) if std::time::Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "`{} {module}` did not finish within {}s",
                        modprobe.display(),
                        MODPROBE_TIMEOUT.as_secs()
                    ));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(format!("waiting for modprobe: {e}")),
            }
        }
    }

    fn probe(&self) -> Result<(), String> {
        probe_in_private_netns()
    }
}

/// Creates a macvlan on a throwaway parent inside a brand-new network
/// namespace owned by a dedicated thread, then removes it. The node's own
/// interfaces are never touched and nothing is visible outside: when the
/// thread ends, the namespace and anything left in it disappear.
pub fn probe_in_private_netns() -> Result<(), String> {
    // A dedicated OS thread: unshare(CLONE_NEWNET) changes the calling
    // thread's namespace for good, so it must never be a pooled thread.
    std::thread::Builder::new()
        .name("macvlan-probe".into())
        .spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                format!("cannot create a private network namespace for the probe: {e}")
            })?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("probe runtime: {e}"))?;
            rt.block_on(probe_links())
        })
        .map_err(|e| format!("cannot start the probe thread: {e}"))?
        .join()
        .map_err(|_| "the probe thread panicked".to_string())?
}

fn netlink_error(e: &rtnetlink::Error) -> String {
    match e {
        rtnetlink::Error::NetlinkError(m) if m.raw_code() != 0 => {
            std::io::Error::from_raw_os_error(-m.raw_code()).to_string()
        }
        other => other.to_string(),
    }
}

async fn link_index(handle: &rtnetlink::Handle, name: &str) -> Result<u32, String> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(msg)) => Ok(msg.header.index),
        Ok(None) => Err(format!("link {name} vanished")),
        Err(e) => Err(format!("looking up {name}: {}", netlink_error(&e))),
    }
}

async fn probe_links() -> Result<(), String> {
    let (conn, handle, _) =
        rtnetlink::new_connection().map_err(|e| format!("netlink socket: {e}"))?;
    tokio::spawn(conn);
    // A parent for the macvlan: veth is present on every Kubernetes node
    // (CNIs use it); dummy is the fallback.
    let veth = handle
        .link()
        .add(LinkVeth::new("hna-probe0", "hna-probe1").build())
        .execute()
        .await;
    if let Err(veth_err) = veth {
        handle
            .link()
            .add(LinkDummy::new("hna-probe0").build())
            .execute()
            .await
            .map_err(|dummy_err| {
                format!(
                    "no parent link for the probe: veth ({}) and dummy ({}) are unavailable",
                    netlink_error(&veth_err),
                    netlink_error(&dummy_err)
                )
            })?;
    }
    let parent = link_index(&handle, "hna-probe0").await?;
    handle
        .link()
        .add(LinkMacVlan::new("hna-probe-mv", parent, MacVlanMode::Bridge).build())
        .execute()
        .await
        .map_err(|e| format!("creating a macvlan link failed: {}", netlink_error(&e)))?;
    let mv = link_index(&handle, "hna-probe-mv").await?;
    handle
        .link()
        .del(mv)
        .execute()
        .await
        .map_err(|e| format!("deleting the probe macvlan failed: {}", netlink_error(&e)))?;
    let _ = handle.link().del(parent).execute().await;
    Ok(())
}
