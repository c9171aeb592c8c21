//! macvlan preflight: is the module there, load it when it is on disk, and
//! prove it works by creating a throwaway macvlan on the uplink.
//!
//! The flow ([`preflight`]) is a plain function over a [`KernelHost`], so the
//! decisions are unit-tested with a fake host; [`host::Host`] is the real one.
//! Loading uses the system's `modprobe`: SUSE's 5.14 kernels ship
//! zstd-compressed modules that only userspace can decompress, and modprobe
//! also applies the distribution's options, softdeps and install rules.

pub(crate) mod detect;
pub mod host;
pub(crate) mod modprobe_d;
pub(crate) mod probe;
pub(crate) mod remedy;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::health::Status;
use detect::{Detection, Facts};
use probe::ProbeError;
use remedy::OsRelease;

/// The module this preflight is about.
pub(crate) const MACVLAN: &str = "macvlan";

/// The shipped modules-load.d entry that loads macvlan at boot.
pub(crate) const MODULES_LOAD_CONF: &str = "/usr/lib/modules-load.d/harvester-node-agent.conf";

/// What the preflight needs from the machine.
pub trait KernelHost {
    fn facts(&self, module: &str) -> Facts;
    /// The modules-load.d (or /etc/modules) file that loads `module` at boot.
    fn boot_persistence(&self, module: &str) -> Option<PathBuf>;
    fn os_release(&self) -> OsRelease;
    /// Loads the module with its dependencies.
    fn load(&self, module: &str) -> Result<(), LoadError>;
    /// Creates a macvlan on the uplink, never up, and deletes it.
    fn probe(&self) -> Result<(), ProbeError>;
}

/// Why a module did not load.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    #[error(
        "the kernel did not load it when asked for a {module} link ({probe}); run `harvester-node-agent check {module} --fix` as root to load it with modprobe and see why"
    )]
    NotLoadedOnRequest { module: String, probe: ProbeError },
    #[error("modprobe is not installed (package kmod); install it or load the module with insmod")]
    NoModprobe,
    #[error("cannot run {}: {error}", modprobe.display())]
    Spawn {
        modprobe: PathBuf,
        error: std::sync::Arc<std::io::Error>,
    },
    #[error("`{} {module}` failed ({status}): {stderr}", modprobe.display())]
    Failed {
        modprobe: PathBuf,
        module: String,
        status: std::process::ExitStatus,
        /// modprobe's own words, trimmed.
        stderr: String,
    },
    #[error("`{} {module}` did not finish within {}s", modprobe.display(), within.as_secs())]
    TimedOut {
        modprobe: PathBuf,
        module: String,
        within: std::time::Duration,
    },
    #[error("waiting for modprobe: {0}")]
    Wait(std::sync::Arc<std::io::Error>),
}

/// Stable reasons, as in `check`, `status` and the `MacvlanReady` condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reason {
    BuiltIn,
    Loaded,
    NotLoaded,
    LoadedByAgent,
    ModuleNotFound,
    Blacklisted,
    LoadFailed,
    ProbeFailed,
    /// The daemon's first preflight was still running when the start-up
    /// budget ran out; the result replaces this when it comes.
    Checking,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::BuiltIn => "BuiltIn",
            Reason::Loaded => "Loaded",
            Reason::NotLoaded => "NotLoaded",
            Reason::LoadedByAgent => "LoadedByAgent",
            Reason::ModuleNotFound => "ModuleNotFound",
            Reason::Blacklisted => "Blacklisted",
            Reason::LoadFailed => "LoadFailed",
            Reason::ProbeFailed => "ProbeFailed",
            Reason::Checking => "Checking",
        }
    }
}

/// The outcome of one preflight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MacvlanState {
    pub status: Status,
    pub reason: Reason,
    pub message: String,
    pub remediation: String,
    /// True when a macvlan link was created successfully just now.
    pub(crate) ready: bool,
    /// Kernel release the result is about.
    pub(crate) kernel: String,
    /// modules-load.d file that loads macvlan at boot, if any.
    pub(crate) loaded_at_boot: Option<PathBuf>,
}

impl MacvlanState {
    /// A preflight under way: not ready, not yet a failure.
    pub(crate) fn checking(message: String) -> MacvlanState {
        MacvlanState {
            status: Status::Warn,
            reason: Reason::Checking,
            message,
            remediation: String::new(),
            ready: false,
            kernel: String::new(),
            loaded_at_boot: None,
        }
    }

    /// The short form for `STATUS=`: `macvlan LoadedByAgent`.
    pub(crate) fn short(&self) -> String {
        format!("macvlan {}", self.reason.as_str())
    }
}

/// Runs the preflight. With `fix`, a module that is on disk but not loaded
/// is loaded (what the daemon does); without, nothing on the host changes.
/// A probe runs only when the module is (or was just) in the kernel: probing
/// an unloaded module would make the kernel auto-load it, which `check`
/// must not do.
pub fn preflight(host: &dyn KernelHost, fix: bool) -> MacvlanState {
    let facts = host.facts(MACVLAN);
    let boot = host.boot_persistence(MACVLAN);
    let boot_note = match &boot {
        Some(f) => format!("; loaded at boot by {}", f.display()),
        None => format!(
            "; not set to load at boot (no modules-load.d entry; the package installs {MODULES_LOAD_CONF})"
        ),
    };
    let v = Verdict {
        host,
        kernel: facts.release.clone(),
        boot,
        boot_note,
    };
    match detect::detect(&facts, MACVLAN) {
        Detection::Loaded => v.probed(Reason::Loaded, "macvlan is loaded"),
        Detection::BuiltIn => v.probed(Reason::BuiltIn, "macvlan is built into the kernel"),
        Detection::NoModuleSupport => v.without_module_support(),
        Detection::Hidden { blacklisted_by } if !blacklisted_by.is_empty() => v.state(
            Status::Fail,
            Reason::Blacklisted,
            format!(
                "macvlan is not loaded and is disabled by {}; the agent does not load a blacklisted module",
                blacklisted_by.join(" and ")
            ),
            "remove that line if DHCP-mode LoadBalancers are wanted on this node, then `systemctl reload harvester-node-agent`",
        ),
        Detection::Hidden { .. } if !fix => v.state(
            Status::Warn,
            Reason::NotLoaded,
            format!(
                "macvlan is not loaded, and this process cannot see kernel {}'s module files{}",
                v.kernel, v.boot_note
            ),
            "run `harvester-node-agent check macvlan` as root to see whether it is on disk",
        ),
        Detection::Hidden { .. } => v.load_through_probe(),
        Detection::Blacklisted { path, by } => v.state(
            Status::Fail,
            Reason::Blacklisted,
            format!(
                "{} is on disk but disabled by {}; the agent does not load a blacklisted module",
                path.display(),
                by.join(" and ")
            ),
            "remove that line if DHCP-mode LoadBalancers are wanted on this node, then `systemctl reload harvester-node-agent`",
        ),
        Detection::ModuleNotFound { detail } => v.module_not_found(&detail),
        Detection::NotLoaded { path, deps } if !fix => v.would_load(&path, &deps),
        Detection::NotLoaded { path, .. } => v.load(&path),
    }
}

/// What every outcome of one preflight says besides its own verdict.
struct Verdict<'a> {
    host: &'a dyn KernelHost,
    kernel: String,
    boot: Option<PathBuf>,
    boot_note: String,
}

impl Verdict<'_> {
    fn state(
        &self,
        status: Status,
        reason: Reason,
        message: String,
        remediation: &str,
    ) -> MacvlanState {
        MacvlanState {
            status,
            reason,
            ready: status == Status::Ok,
            message,
            remediation: remediation.to_string(),
            kernel: self.kernel.clone(),
            loaded_at_boot: self.boot.clone(),
        }
    }

    /// The module is in the kernel: a test link proves it works.
    fn probed(&self, reason: Reason, what: &str) -> MacvlanState {
        let kernel = &self.kernel;
        match self.host.probe() {
            Ok(()) => self.state(
                Status::Ok,
                reason,
                format!(
                    "{what} in kernel {kernel}; a test macvlan link was created and removed{}",
                    self.boot_note
                ),
                "",
            ),
            Err(e) => self.state(
                Status::Fail,
                Reason::ProbeFailed,
                format!("{what} in kernel {kernel}, but creating a macvlan link failed: {e}"),
                probe_remedy(&e),
            ),
        }
    }

    /// No loadable modules: only a test link tells whether macvlan is
    /// built in.
    fn without_module_support(&self) -> MacvlanState {
        let kernel = &self.kernel;
        match self.host.probe() {
            Ok(()) => self.state(
                Status::Ok,
                Reason::BuiltIn,
                format!(
                    "kernel {kernel} has no loadable-module support and macvlan is built in; a test macvlan link was created and removed"
                ),
                "",
            ),
            Err(e @ ProbeError::Unsupported(_)) => self.state(
                Status::Fail,
                Reason::ModuleNotFound,
                format!(
                    "kernel {kernel} has no loadable-module support and no built-in macvlan ({e})"
                ),
                "boot a kernel built with CONFIG_MACVLAN=y or =m",
            ),
            Err(e) => self.state(
                Status::Fail,
                Reason::ProbeFailed,
                format!(
                    "kernel {kernel} has no loadable-module support, and whether macvlan is built in is unknown: creating a macvlan link failed: {e}"
                ),
                probe_remedy(&e),
            ),
        }
    }

    /// The sandboxed daemon: the probe's macvlan link makes the kernel load
    /// the module itself (modprobe of `rtnl-link-macvlan`), which needs no
    /// CAP_SYS_MODULE here.
    fn load_through_probe(&self) -> MacvlanState {
        let kernel = &self.kernel;
        match self.host.probe() {
            Ok(()) => {
                let (reason, what) = match self.host.facts(MACVLAN).sys_module {
                    detect::SysModule::BuiltIn => {
                        (Reason::BuiltIn, "macvlan is built into the kernel")
                    }
                    _ => (
                        Reason::LoadedByAgent,
                        "the kernel loaded macvlan for the agent's test link",
                    ),
                };
                self.state(
                    Status::Ok,
                    reason,
                    format!(
                        "{what} in kernel {kernel}; a test macvlan link was created and removed{}",
                        self.boot_note
                    ),
                    "",
                )
            }
            Err(e @ ProbeError::Unsupported(_)) => {
                let os = self.host.os_release();
                let r = remedy::module_not_found(&os, kernel);
                self.state(
                    Status::Fail,
                    Reason::ModuleNotFound,
                    format!(
                        "the kernel could not load macvlan when asked for a macvlan link ({e}): it is not installed for kernel {kernel} (package {}) or the kernel refused it; `harvester-node-agent check macvlan` run as root says which",
                        r.package
                    ),
                    &r.remediation,
                )
            }
            Err(e) => self.state(
                Status::Fail,
                Reason::ProbeFailed,
                format!("macvlan was not loaded and creating a macvlan link failed: {e}"),
                probe_remedy(&e),
            ),
        }
    }

    fn module_not_found(&self, detail: &str) -> MacvlanState {
        let os = self.host.os_release();
        let r = remedy::module_not_found(&os, &self.kernel);
        self.state(
            Status::Fail,
            Reason::ModuleNotFound,
            format!(
                "{detail}; the package that should carry it is {} ({}). DHCP-mode LoadBalancer Services would stay <pending> with \"operation not supported\"",
                r.package,
                if os.pretty_name.is_empty() {
                    "unknown distribution"
                } else {
                    &os.pretty_name
                }
            ),
            &r.remediation,
        )
    }

    /// On disk, not loaded, and this run may not change the host: what the
    /// daemon would load.
    fn would_load(&self, path: &std::path::Path, deps: &[PathBuf]) -> MacvlanState {
        let with = if deps.is_empty() {
            String::new()
        } else {
            format!(
                " with {}",
                deps.iter()
                    .map(|d| detect::module_name_of(&d.to_string_lossy()))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        self.state(
            Status::Warn,
            Reason::NotLoaded,
            format!(
                "{} is on disk but not loaded; the daemon loads it{with} at start{}",
                path.display(),
                self.boot_note
            ),
            "start the daemon, or run `harvester-node-agent check --fix` to load it now",
        )
    }

    /// Loads the module, then believes /proc/modules rather than modprobe's
    /// exit status (an `install` rule may do anything).
    fn load(&self, path: &std::path::Path) -> MacvlanState {
        if let Err(e) = self.host.load(MACVLAN) {
            return self.state(
                Status::Fail,
                Reason::LoadFailed,
                format!("loading {} failed: {e}", path.display()),
                "see `dmesg` for why the kernel refused it (signature, version magic, missing symbols)",
            );
        }
        match detect::detect(&self.host.facts(MACVLAN), MACVLAN) {
            Detection::Loaded => self.probed(Reason::LoadedByAgent, "the agent loaded macvlan"),
            other => self.state(
                Status::Fail,
                Reason::LoadFailed,
                format!(
                    "modprobe reported success but macvlan is not in /proc/modules ({other:?})"
                ),
                "check the modprobe.d `install` rules for macvlan",
            ),
        }
    }
}

/// What to do when the probe fails.
fn probe_remedy(e: &ProbeError) -> &'static str {
    match e {
        ProbeError::NoParent(_) => {
            "DHCP-mode LoadBalancer addresses are macvlans on the node's Ethernet uplink: give the node one (see `ip -d link`)"
        }
        ProbeError::Unsupported(_) | ProbeError::Failed(_) => {
            "check `dmesg` for macvlan errors and that the agent runs with CAP_NET_ADMIN (the shipped unit grants it)"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    struct Fake {
        facts: RefCell<Facts>,
        load_result: Result<(), LoadError>,
        probe_result: Result<(), ProbeError>,
        loads: RefCell<u32>,
        probes: RefCell<u32>,
        os: &'static str,
    }

    impl Fake {
        fn new(proc_modules: Option<&str>, dep: &str) -> Self {
            let dir = "/lib/modules/6.1.0-56-amd64";
            Fake {
                facts: RefCell::new(Facts {
                    release: "6.1.0-56-amd64".into(),
                    proc_modules: proc_modules.map(str::to_string),
                    modules_dir: Some(dir.into()),
                    modules_builtin: Some(String::new()),
                    modules_dep: Some(dep.into()),
                    existing_files: vec![format!("{dir}/kernel/drivers/net/macvlan.ko").into()],
                    blacklisted_by: vec![],
                    sys_module: detect::SysModule::Absent,
                    tree_hidden: false,
                }),
                load_result: Ok(()),
                probe_result: Ok(()),
                loads: RefCell::new(0),
                probes: RefCell::new(0),
                os: "ID=debian\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n",
            }
        }
    }

    impl KernelHost for Fake {
        fn facts(&self, _: &str) -> Facts {
            self.facts.borrow().clone()
        }
        fn boot_persistence(&self, _: &str) -> Option<PathBuf> {
            None
        }
        fn os_release(&self) -> OsRelease {
            OsRelease::parse(self.os)
        }
        fn load(&self, _: &str) -> Result<(), LoadError> {
            *self.loads.borrow_mut() += 1;
            if self.load_result.is_ok() {
                self.facts.borrow_mut().proc_modules = Some("macvlan 1 0 - Live 0x0\n".into());
            }
            self.load_result.clone()
        }
        fn probe(&self) -> Result<(), ProbeError> {
            *self.probes.borrow_mut() += 1;
            if self.probe_result.is_ok() {
                // A macvlan link makes the kernel load the module.
                self.facts.borrow_mut().sys_module = detect::SysModule::Live;
            }
            self.probe_result.clone()
        }
    }

    /// The daemon's view under its unit: no /proc/modules, no module tree.
    fn sandboxed() -> Fake {
        let host = Fake::new(None, DEP);
        {
            let mut f = host.facts.borrow_mut();
            f.modules_dep = None;
            f.existing_files.clear();
            f.tree_hidden = true;
        }
        host
    }

    #[test]
    fn the_sandboxed_daemon_has_the_kernel_load_it_through_the_probe() {
        let host = sandboxed();
        let s = preflight(&host, true);
        assert_eq!(
            (s.status, s.reason, s.ready),
            (Status::Ok, Reason::LoadedByAgent, true),
            "{s:?}"
        );
        assert_eq!((*host.loads.borrow(), *host.probes.borrow()), (0, 1));

        // Loaded already: sysfs says so without /proc/modules.
        let s = preflight(&host, true);
        assert_eq!((s.status, s.reason), (Status::Ok, Reason::Loaded));
    }

    #[test]
    fn the_sandboxed_daemon_reports_what_it_cannot_see_with_the_way_to_see_it() {
        let mut host = sandboxed();
        host.probe_result = Err(ProbeError::Unsupported("Operation not supported".into()));
        let s = preflight(&host, true);
        assert_eq!((s.status, s.reason), (Status::Fail, Reason::ModuleNotFound));
        assert!(
            s.message.contains("check macvlan` run as root"),
            "{}",
            s.message
        );
        assert!(s.message.contains("linux-image"), "{}", s.message);

        // Without --fix nothing is probed (a probe would load it).
        let host = sandboxed();
        let s = preflight(&host, false);
        assert_eq!((s.status, s.reason), (Status::Warn, Reason::NotLoaded));
        assert_eq!(*host.probes.borrow(), 0);

        // modprobe.d is still readable: a blacklist is honoured, not probed.
        let host = sandboxed();
        host.facts.borrow_mut().blacklisted_by =
            vec!["/etc/modprobe.d/no.conf: blacklist macvlan".into()];
        let s = preflight(&host, true);
        assert_eq!((s.status, s.reason), (Status::Fail, Reason::Blacklisted));
        assert_eq!(*host.probes.borrow(), 0);
    }

    const DEP: &str = "kernel/drivers/net/macvlan.ko:\n";

    #[test]
    fn check_without_fix_changes_nothing_and_does_not_probe() {
        let host = Fake::new(Some(""), DEP);
        let s = preflight(&host, false);
        assert_eq!((s.status, s.reason), (Status::Warn, Reason::NotLoaded));
        assert_eq!((*host.loads.borrow(), *host.probes.borrow()), (0, 0));
        assert!(s.message.contains("not set to load at boot"));
    }

    #[test]
    fn fix_loads_then_probes() {
        let host = Fake::new(Some(""), DEP);
        let s = preflight(&host, true);
        assert_eq!(
            (s.status, s.reason, s.ready),
            (Status::Ok, Reason::LoadedByAgent, true)
        );
        assert_eq!((*host.loads.borrow(), *host.probes.borrow()), (1, 1));
    }

    #[test]
    fn load_and_probe_failures_are_reported() {
        let mut host = Fake::new(Some(""), DEP);
        host.load_result = Err(LoadError::Failed {
            modprobe: "/sbin/modprobe".into(),
            module: "macvlan".into(),
            status: std::os::unix::process::ExitStatusExt::from_raw(1 << 8),
            stderr: "modprobe: ERROR: could not insert 'macvlan': Exec format error".into(),
        });
        let s = preflight(&host, true);
        assert_eq!((s.status, s.reason), (Status::Fail, Reason::LoadFailed));
        assert!(s.message.contains("Exec format error"));

        let mut host = Fake::new(Some("macvlan 1 0 - Live 0x0\n"), DEP);
        host.probe_result = Err(ProbeError::Failed(
            "every parent refused it (on eth0: Device or resource busy)".into(),
        ));
        let s = preflight(&host, false);
        assert_eq!((s.reason, s.ready), (Reason::ProbeFailed, false));
        assert!(s.message.contains("on eth0: Device or resource busy"));
        assert!(s.remediation.contains("CAP_NET_ADMIN"));
        assert!(!s.remediation.contains("CAP_SYS_ADMIN"));

        let mut host = Fake::new(Some("macvlan 1 0 - Live 0x0\n"), DEP);
        host.probe_result = Err(ProbeError::NoParent("found lo (not Ethernet)".into()));
        let s = preflight(&host, false);
        assert_eq!((s.status, s.reason), (Status::Fail, Reason::ProbeFailed));
        assert!(s.message.contains("lo (not Ethernet)"), "{}", s.message);
        assert!(s.remediation.contains("Ethernet uplink"));
    }

    #[test]
    fn missing_module_names_kernel_package_and_remedy() {
        let mut host = Fake::new(Some(""), "kernel/drivers/net/veth.ko:\n");
        host.os =
            "ID=\"sles\"\nID_LIKE=\"suse\"\nPRETTY_NAME=\"SUSE Linux Enterprise Server 15 SP5\"\n";
        let s = preflight(&host, true);
        assert_eq!((s.status, s.reason), (Status::Fail, Reason::ModuleNotFound));
        assert!(
            s.message.contains("6.1.0-56-amd64") && s.message.contains("kernel-default-base"),
            "{}",
            s.message
        );
        assert!(
            s.remediation
                .contains("zypper --non-interactive in kernel-default")
        );
        assert_eq!(*host.loads.borrow(), 0);
    }

    #[test]
    fn blacklisted_is_not_loaded_even_with_fix() {
        let host = Fake::new(Some(""), DEP);
        host.facts.borrow_mut().blacklisted_by =
            vec!["/etc/modprobe.d/b.conf: blacklist macvlan".into()];
        let s = preflight(&host, true);
        assert_eq!((s.status, s.reason), (Status::Fail, Reason::Blacklisted));
        assert!(s.message.contains("/etc/modprobe.d/b.conf"));
        assert_eq!(*host.loads.borrow(), 0);
    }

    #[test]
    fn kernel_without_modules_is_builtin_when_the_probe_works() {
        let host = Fake::new(None, DEP);
        assert_eq!(preflight(&host, false).reason, Reason::BuiltIn);
        let mut host = Fake::new(None, DEP);
        host.probe_result = Err(ProbeError::Unsupported("Operation not supported".into()));
        assert_eq!(preflight(&host, false).reason, Reason::ModuleNotFound);
        // Without a parent nothing is known about macvlan: not "not found".
        let mut host = Fake::new(None, DEP);
        host.probe_result = Err(ProbeError::NoParent("found no interfaces".into()));
        assert_eq!(preflight(&host, false).reason, Reason::ProbeFailed);
    }
}
