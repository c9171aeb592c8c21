//! The real host behind [`super::KernelHost`]: files under /proc, /lib/modules
//! and modprobe.d, the system's `modprobe`, and a netlink probe on the uplink.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use futures::TryStreamExt;
use rtnetlink::packet_route::link::{
    LinkAttribute, LinkFlags, LinkInfo, LinkLayerType, LinkMessage, MacVlanMode,
};
use rtnetlink::packet_route::route::{RouteAttribute, RouteHeader, RouteMessage};
use rtnetlink::{LinkMacVlan, RouteMessageBuilder};

use super::detect::{self, Facts, SysModule};
use super::modprobe_d;
use super::probe::{self, LinkFacts, ProbeError};
use super::remedy::OsRelease;
use super::{KernelHost, LoadError};

/// How long `modprobe` may take before the load counts as failed.
const MODPROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// The running system. `root` is `/` except in tests.
#[derive(Debug, Clone)]
pub struct Host {
    pub(crate) root: PathBuf,
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

impl Host {
    fn sys_module(&self, module: &str) -> SysModule {
        let dir = self.path("/sys/module").join(detect::normalize(module));
        if !dir.is_dir() {
            return SysModule::Absent;
        }
        match std::fs::read_to_string(dir.join("initstate")) {
            Ok(state) if matches!(state.trim(), "live" | "coming") => SysModule::Live,
            // Going away: as good as absent for a probe.
            Ok(_) => SysModule::Absent,
            Err(_) => SysModule::BuiltIn,
        }
    }

    /// Whether a sandbox hides what detection reads: the kernel loads
    /// modules (some `/sys/module/*/initstate` exists) yet `/proc/modules`
    /// cannot be read or no module directory of any kernel can be listed
    /// (systemd mounts an empty one over both).
    fn tree_hidden(&self, facts: &Facts) -> bool {
        let listed = |p: &str| {
            std::fs::read_dir(self.path(p))
                .into_iter()
                .flatten()
                .flatten()
                .next()
                .is_some()
        };
        let kernel_loads_modules = std::fs::read_dir(self.path("/sys/module"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| e.path().join("initstate").is_file());
        kernel_loads_modules
            && (facts.proc_modules.is_none()
                || !(listed("/lib/modules") || listed("/usr/lib/modules")))
    }
}

/// Whether this process may load modules itself (CAP_SYS_MODULE in its
/// effective set). The daemon's unit takes it away; `check --fix` run by
/// root has it.
fn may_load_modules() -> bool {
    const CAP_SYS_MODULE: u32 = 16;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|eff| eff & (1 << CAP_SYS_MODULE) != 0)
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
            sys_module: self.sys_module(module),
            tree_hidden: false,
        };
        facts.tree_hidden = self.tree_hidden(&facts);
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

    fn load(&self, module: &str) -> Result<(), LoadError> {
        if !may_load_modules() {
            // Without CAP_SYS_MODULE the kernel still loads it on request:
            // creating a macvlan link makes it run modprobe for the alias
            // `rtnl-link-macvlan`, which honours modprobe.d's blacklist.
            return self.probe().map_err(|probe| LoadError::NotLoadedOnRequest {
                module: module.to_string(),
                probe,
            });
        }
        let Some(modprobe) = find_modprobe() else {
            return Err(LoadError::NoModprobe);
        };
        let mut child = Command::new(&modprobe)
            .arg("--quiet")
            .arg("--")
            .arg(module)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| LoadError::Spawn {
                modprobe: modprobe.clone(),
                error: std::sync::Arc::new(e),
            })?;
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
                        Err(LoadError::Failed {
                            modprobe,
                            module: module.to_string(),
                            status,
                            stderr: stderr.trim().to_string(),
                        })
                    };
                }
                Ok(None) if std::time::Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(LoadError::TimedOut {
                        modprobe,
                        module: module.to_string(),
                        within: MODPROBE_TIMEOUT,
                    });
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(LoadError::Wait(std::sync::Arc::new(e))),
            }
        }
    }

    fn probe(&self) -> Result<(), ProbeError> {
        probe_on_uplink()
    }
}

/// One probe at a time in a process: the link name is per process.
static PROBE: Mutex<()> = Mutex::new(());

/// Creates a macvlan on the node's uplink, DOWN, and deletes it at once
/// (see [`super::probe`] for why the uplink). Leftovers of a process killed
/// mid-probe are removed first.
pub(crate) fn probe_on_uplink() -> Result<(), ProbeError> {
    let _one = PROBE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // A thread with its own runtime: callers are plain threads, blocking-pool
    // threads or code already inside a runtime, where block_on would panic.
    std::thread::Builder::new()
        .name("macvlan-probe".into())
        .spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| ProbeError::Failed(format!("probe runtime: {e}")))?;
            rt.block_on(probe_links())
        })
        .map_err(|e| ProbeError::Failed(format!("cannot start the probe thread: {e}")))?
        .join()
        .map_err(|_| ProbeError::Failed("the probe thread panicked".into()))?
}

fn errno(e: &rtnetlink::Error) -> i32 {
    match e {
        rtnetlink::Error::NetlinkError(m) => -m.raw_code(),
        _ => 0,
    }
}

fn netlink_error(e: &rtnetlink::Error) -> String {
    match e {
        rtnetlink::Error::NetlinkError(m) if m.raw_code() != 0 => {
            std::io::Error::from_raw_os_error(-m.raw_code()).to_string()
        }
        other => other.to_string(),
    }
}

fn link_facts(msg: &LinkMessage) -> LinkFacts {
    let mut facts = LinkFacts {
        index: msg.header.index,
        name: String::new(),
        ethernet: msg.header.link_layer_type == LinkLayerType::Ether
            && !msg.header.flags.contains(LinkFlags::Loopback),
        controller: None,
        kind: None,
    };
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(name) => facts.name = name.clone(),
            LinkAttribute::Controller(index) => facts.controller = Some(*index),
            LinkAttribute::LinkInfo(infos) => {
                facts.kind = infos.iter().find_map(|i| match i {
                    LinkInfo::Kind(kind) => Some(kind.to_string()),
                    _ => None,
                });
            }
            _ => {}
        }
    }
    facts
}

async fn links(handle: &rtnetlink::Handle) -> Result<Vec<LinkFacts>, ProbeError> {
    let msgs: Vec<LinkMessage> = handle
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(|e| ProbeError::Failed(format!("listing links: {}", netlink_error(&e))))?;
    Ok(msgs.iter().map(link_facts).collect())
}

/// The outgoing interface of the main table's IPv4 default route with the
/// lowest metric; `None` when there is none (or it is multipath).
async fn default_route(handle: &rtnetlink::Handle) -> Option<u32> {
    let routes: Vec<RouteMessage> = handle
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute()
        .try_collect()
        .await
        .ok()?;
    routes
        .iter()
        .filter(|r| r.header.destination_prefix_length == 0)
        .filter_map(|r| {
            let mut table = u32::from(r.header.table);
            let (mut oif, mut metric) = (None, 0);
            for attr in &r.attributes {
                match attr {
                    RouteAttribute::Table(t) => table = *t,
                    RouteAttribute::Oif(i) => oif = Some(*i),
                    RouteAttribute::Priority(p) => metric = *p,
                    _ => {}
                }
            }
            (table == u32::from(RouteHeader::RT_TABLE_MAIN))
                .then_some(oif.map(|oif| (metric, oif)))
                .flatten()
        })
        .min()
        .map(|(_, oif)| oif)
}

/// By signal 0, not by /proc: the daemon's unit hides other users'
/// processes there (`ProtectProc=invisible`), and a root `check` probing at
/// the same time must not look dead to it.
fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

async fn delete_link(handle: &rtnetlink::Handle, index: u32) -> Result<(), rtnetlink::Error> {
    match handle.link().del(index).execute().await {
        Err(e) if errno(&e) == libc::ENODEV => Ok(()),
        other => other,
    }
}

async fn probe_links() -> Result<(), ProbeError> {
    let (conn, handle, _) = rtnetlink::new_connection()
        .map_err(|e| ProbeError::Failed(format!("netlink socket: {e}")))?;
    tokio::spawn(conn);
    let links = links(&handle).await?;
    let pid = std::process::id();
    for stale in probe::leftovers(&links, pid, pid_alive) {
        delete_link(&handle, stale.index).await.map_err(|e| {
            ProbeError::Failed(format!(
                "cannot delete {}, left by an earlier probe: {}",
                stale.name,
                netlink_error(&e)
            ))
        })?;
    }
    let parents = probe::parents(&links, default_route(&handle).await);
    if parents.is_empty() {
        return Err(ProbeError::NoParent(probe::no_parent_detail(&links)));
    }
    let name = probe::link_name(pid);
    let mut refused = Vec::new();
    for parent in parents {
        let mac = probe::link_mac(std::array::from_fn(|_| fastrand::u8(..)));
        let created = handle
            .link()
            .add(
                LinkMacVlan::new(&name, parent.index, MacVlanMode::Bridge)
                    .address(mac.to_vec())
                    .build(),
            )
            .execute()
            .await;
        match created {
            Ok(()) => {
                let mut found = handle.link().get().match_name(name.clone()).execute();
                let index = match found.try_next().await {
                    Ok(Some(msg)) => msg.header.index,
                    Ok(None) => return Ok(()),
                    Err(e) if errno(&e) == libc::ENODEV => return Ok(()),
                    Err(e) => {
                        return Err(ProbeError::Failed(format!(
                            "created {name} on {} but cannot find it to delete it: {}",
                            parent.name,
                            netlink_error(&e)
                        )));
                    }
                };
                return delete_link(&handle, index).await.map_err(|e| {
                    ProbeError::Failed(format!(
                        "created {name} on {} but cannot delete it: {}",
                        parent.name,
                        netlink_error(&e)
                    ))
                });
            }
            Err(e) if errno(&e) == libc::EOPNOTSUPP => {
                return Err(ProbeError::Unsupported(netlink_error(&e)));
            }
            Err(e) => refused.push(format!("on {}: {}", parent.name, netlink_error(&e))),
        }
    }
    Err(ProbeError::Failed(format!(
        "every parent refused it ({})",
        refused.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    //! The real probe against the kernel, each test in a network namespace
    //! of its own (root only) where a veth stands in for the node's NIC.

    use super::*;
    use futures::StreamExt;
    use rtnetlink::packet_core::NetlinkPayload;
    use rtnetlink::packet_route::RouteNetlinkMessage;
    use rtnetlink::{LinkUnspec, LinkVeth, MulticastGroup};

    /// Runs `f` on a thread in a new network namespace (gone with the
    /// thread) with a current-thread runtime. Root only: the tests using it
    /// are ignored by a plain `cargo test` and run by `tests/run.sh`.
    fn in_netns<T: Send>(f: impl FnOnce(&tokio::runtime::Runtime) -> T + Send) -> Option<T> {
        assert!(
            nix::unistd::geteuid().is_root(),
            "the probe tests need root (network namespaces): run `sudo -E cargo test --lib -- --ignored`"
        );
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare");
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let _in_runtime = rt.enter();
                f(&rt)
            })
            .join()
            .unwrap()
        })
        .into()
    }

    async fn index_of(handle: &rtnetlink::Handle, name: &str) -> Option<u32> {
        let mut s = handle.link().get().match_name(name.to_string()).execute();
        s.try_next().await.ok().flatten().map(|m| m.header.index)
    }

    async fn names(handle: &rtnetlink::Handle) -> Vec<String> {
        links(handle)
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.name)
            .collect()
    }

    /// `eth0` (a veth whose peer stays here too), up, with the default
    /// route: what the probe takes for the uplink. Returns its index.
    async fn uplink(handle: &rtnetlink::Handle) -> u32 {
        handle
            .link()
            .add(LinkVeth::new("eth0", "peer0").build())
            .execute()
            .await
            .unwrap();
        let eth0 = index_of(handle, "eth0").await.unwrap();
        handle
            .link()
            .set(LinkUnspec::new_with_index(eth0).up().build())
            .execute()
            .await
            .unwrap();
        handle
            .route()
            .add(
                RouteMessageBuilder::<Ipv4Addr>::new()
                    .output_interface(eth0)
                    .scope(rtnetlink::packet_route::route::RouteScope::Link)
                    .build(),
            )
            .execute()
            .await
            .unwrap();
        eth0
    }

    /// Drops CAP_SYS_ADMIN from this thread's effective and permitted sets
    /// (capabilities are per thread; threads it starts inherit them).
    fn drop_cap_sys_admin() {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        const CAP_SYS_ADMIN: u32 = 21;
        let mut header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let mut data = [Data::default(); 2];
        // SAFETY: header and a two-element data array, as capget(2) and
        // capset(2) take for version 3.
        unsafe {
            assert_eq!(
                libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()),
                0
            );
            data[0].effective &= !(1 << CAP_SYS_ADMIN);
            data[0].permitted &= !(1 << CAP_SYS_ADMIN);
            assert_eq!(
                libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()),
                0
            );
        }
    }

    #[test]
    #[ignore = "needs root (a private network namespace); tests/run.sh runs it"]
    fn probe_creates_a_down_macvlan_on_the_uplink_and_removes_it_without_cap_sys_admin() {
        in_netns(|rt| {
            let (conn, handle, _) = rtnetlink::new_connection().unwrap();
            let _conn = rt.spawn(conn);
            let eth0 = rt.block_on(uplink(&handle));
            // Listen to every link change in this namespace before probing.
            let (mon, _, mut events) =
                rtnetlink::new_multicast_connection(&[MulticastGroup::Link]).unwrap();
            let _mon = rt.spawn(mon);

            drop_cap_sys_admin();
            assert_eq!(
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET),
                Err(nix::errno::Errno::EPERM),
                "CAP_SYS_ADMIN was not dropped"
            );
            probe_on_uplink().unwrap();

            let name = probe::link_name(std::process::id());
            let (mut created, mut deleted) = (Vec::new(), false);
            rt.block_on(async {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                while !deleted {
                    let Ok(Some((msg, _))) = tokio::time::timeout_at(deadline, events.next()).await
                    else {
                        break;
                    };
                    match msg.payload {
                        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l))
                            if link_facts(&l).name == name =>
                        {
                            created.push(l)
                        }
                        NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(l)) => {
                            deleted |= link_facts(&l).name == name
                        }
                        _ => {}
                    }
                }
            });
            assert!(!created.is_empty(), "no RTM_NEWLINK for {name}");
            assert!(deleted, "no RTM_DELLINK for {name}");
            for l in &created {
                assert!(!l.header.flags.contains(LinkFlags::Up), "{name} was up");
                assert!(l.attributes.contains(&LinkAttribute::Link(eth0)), "{l:?}");
                assert_eq!(link_facts(l).kind.as_deref(), Some("macvlan"));
            }
            let mut left = rt.block_on(names(&handle));
            left.sort();
            assert_eq!(left, ["eth0", "lo", "peer0"]);
        });
    }

    #[test]
    #[ignore = "needs root (a private network namespace); tests/run.sh runs it"]
    fn probe_without_an_ethernet_interface_says_so() {
        in_netns(|_| {
            let err = probe_on_uplink().unwrap_err();
            assert!(
                matches!(&err, ProbeError::NoParent(d) if d.contains("lo (not Ethernet)")),
                "{err:?}"
            );
        });
    }

    #[test]
    #[ignore = "needs root (a private network namespace); tests/run.sh runs it"]
    fn probe_removes_leftovers_of_dead_processes_only() {
        in_netns(|rt| {
            let (conn, handle, _) = rtnetlink::new_connection().unwrap();
            let _conn = rt.spawn(conn);
            let eth0 = rt.block_on(uplink(&handle));
            // pid_max is at most 2^22, so no process has that pid; pid 1
            // always runs.
            let dead = probe::link_name(1 << 22);
            let alive = probe::link_name(1);
            for name in [&dead, &alive] {
                rt.block_on(
                    handle
                        .link()
                        .add(LinkMacVlan::new(name, eth0, MacVlanMode::Bridge).build())
                        .execute(),
                )
                .unwrap();
            }
            probe_on_uplink().unwrap();
            let left = rt.block_on(names(&handle));
            assert!(!left.contains(&dead), "{left:?}");
            assert!(left.contains(&alive), "{left:?}");
        });
    }
}
