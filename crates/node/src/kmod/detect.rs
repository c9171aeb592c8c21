//! Where the module stands on the running kernel, from facts read off the
//! host. Pure: the facts are plain data, so every case is unit-testable.

use std::path::{Path, PathBuf};

/// Everything detection needs, read from the host by [`super::host`].
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// `uname -r`.
    pub(crate) release: String,
    /// `/proc/modules`; `None` when the kernel has no loadable-module support.
    pub(crate) proc_modules: Option<String>,
    /// The module directory of this release (`/lib/modules/<release>` or
    /// `/usr/lib/modules/<release>`), if it exists.
    pub(crate) modules_dir: Option<PathBuf>,
    /// `modules.builtin` of this release.
    pub(crate) modules_builtin: Option<String>,
    /// `modules.dep` of this release.
    pub(crate) modules_dep: Option<String>,
    /// Module files (absolute paths) that exist on disk, among those
    /// `modules.dep` names for the module and its dependencies.
    pub(crate) existing_files: Vec<PathBuf>,
    /// Blacklist entries that name the module (see [`super::modprobe_d`]).
    pub(crate) blacklisted_by: Vec<String>,
    /// `/sys/module/<module>`, which stays visible where a sandbox hides
    /// `/proc/modules` and the module tree.
    pub(crate) sys_module: SysModule,
    /// The module tree (and maybe `/proc/modules`) is hidden from this
    /// process, as systemd's `ProtectKernelModules=` and `ProcSubset=pid`
    /// hide them from the daemon: only the kernel's own autoload can tell
    /// whether the module is on disk.
    pub(crate) tree_hidden: bool,
}

/// What `/sys/module/<module>` says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum SysModule {
    /// No such directory: not loaded (or built in without parameters).
    #[default]
    Absent,
    /// A directory without `initstate`: built into the kernel.
    BuiltIn,
    /// `initstate` is `live` (or `coming`): a loaded module.
    Live,
}

/// What detection found, before any load or probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Detection {
    /// Listed in `/proc/modules`.
    Loaded,
    /// Listed in `modules.builtin`.
    BuiltIn,
    /// The kernel cannot load modules at all; only a probe can tell whether
    /// macvlan is compiled in.
    NoModuleSupport,
    /// On disk, not loaded; `deps` in load order (dependencies first).
    NotLoaded { path: PathBuf, deps: Vec<PathBuf> },
    /// On disk but disabled by configuration.
    Blacklisted { path: PathBuf, by: Vec<String> },
    /// Not on disk for this kernel.
    ModuleNotFound { detail: String },
    /// Neither loaded nor built in, and the module tree is hidden from this
    /// process: whether it can be loaded is for the kernel's autoload to
    /// say. `blacklisted_by` is what modprobe.d (still readable) says.
    Hidden { blacklisted_by: Vec<String> },
}

/// Kernel module names treat `-` and `_` alike.
pub(crate) fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// The module name a `modules.dep` path stands for:
/// `kernel/drivers/net/macvlan.ko.zst` → `macvlan`.
pub(crate) fn module_name_of(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = [".ko.xz", ".ko.zst", ".ko.gz", ".ko"]
        .iter()
        .find_map(|ext| file.strip_suffix(ext))
        .unwrap_or(file);
    normalize(stem)
}

/// Whether `/proc/modules` lists the module.
pub(crate) fn is_loaded(proc_modules: &str, module: &str) -> bool {
    let module = normalize(module);
    proc_modules
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .any(|m| normalize(m) == module)
}

pub(crate) fn is_builtin(modules_builtin: &str, module: &str) -> bool {
    let module = normalize(module);
    modules_builtin
        .lines()
        .any(|l| !l.trim().is_empty() && module_name_of(l.trim()) == module)
}

/// The module's file and its dependencies (load order: dependencies first,
/// as `modprobe` loads them) from `modules.dep`. Paths are resolved against
/// `modules_dir` when relative.
pub(crate) fn resolve(
    modules_dep: &str,
    modules_dir: &Path,
    module: &str,
) -> Option<(PathBuf, Vec<PathBuf>)> {
    let module = normalize(module);
    let abs = |p: &str| {
        let p = Path::new(p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            modules_dir.join(p)
        }
    };
    modules_dep.lines().find_map(|line| {
        let (file, deps) = line.split_once(':')?;
        if module_name_of(file.trim()) != module {
            return None;
        }
        // modules.dep lists direct and indirect dependencies, the ones
        // needed last first; loading goes in reverse.
        let mut deps: Vec<PathBuf> = deps.split_whitespace().map(abs).collect();
        deps.reverse();
        Some((abs(file.trim()), deps))
    })
}

/// Every module file that must exist for `module` to load, per modules.dep.
pub(crate) fn files_needed(facts: &Facts, module: &str) -> Vec<PathBuf> {
    match (&facts.modules_dep, &facts.modules_dir) {
        (Some(dep), Some(dir)) => resolve(dep, dir, module)
            .map(|(path, deps)| deps.into_iter().chain(std::iter::once(path)).collect())
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

pub(crate) fn detect(facts: &Facts, module: &str) -> Detection {
    match facts.sys_module {
        SysModule::Live => return Detection::Loaded,
        SysModule::BuiltIn => return Detection::BuiltIn,
        SysModule::Absent => {}
    }
    if facts
        .proc_modules
        .as_deref()
        .is_some_and(|p| is_loaded(p, module))
    {
        return Detection::Loaded;
    }
    if facts.tree_hidden {
        return Detection::Hidden {
            blacklisted_by: facts.blacklisted_by.clone(),
        };
    }
    if facts.proc_modules.is_none() {
        return Detection::NoModuleSupport;
    }
    if facts
        .modules_builtin
        .as_deref()
        .is_some_and(|b| is_builtin(b, module))
    {
        return Detection::BuiltIn;
    }
    let Some(dir) = &facts.modules_dir else {
        return Detection::ModuleNotFound {
            detail: format!("there is no module directory for kernel {}", facts.release),
        };
    };
    let Some(dep) = &facts.modules_dep else {
        return Detection::ModuleNotFound {
            detail: format!(
                "{}/modules.dep is missing (run `depmod -a {}`)",
                dir.display(),
                facts.release
            ),
        };
    };
    let Some((path, deps)) = resolve(dep, dir, module) else {
        return Detection::ModuleNotFound {
            detail: format!(
                "kernel {} has no {module} module ({}/modules.dep does not list it)",
                facts.release,
                dir.display()
            ),
        };
    };
    let missing: Vec<&PathBuf> = deps
        .iter()
        .chain(std::iter::once(&path))
        .filter(|p| !facts.existing_files.contains(p))
        .collect();
    if let Some(first) = missing.first() {
        return Detection::ModuleNotFound {
            detail: format!(
                "modules.dep lists {} but it is not on disk",
                first.display()
            ),
        };
    }
    if !facts.blacklisted_by.is_empty() {
        return Detection::Blacklisted {
            path,
            by: facts.blacklisted_by.clone(),
        };
    }
    Detection::NotLoaded { path, deps }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIR: &str = "/lib/modules/6.1.0-56-amd64";

    fn facts() -> Facts {
        Facts {
            release: "6.1.0-56-amd64".into(),
            proc_modules: Some("veth 36864 0 - Live 0x0\nbridge 311296 0 - Live 0x0\n".into()),
            modules_dir: Some(DIR.into()),
            modules_builtin: Some("kernel/net/unix/unix.ko\n".into()),
            modules_dep: Some(
                "kernel/drivers/net/veth.ko:\nkernel/drivers/net/macvlan.ko:\nkernel/drivers/net/macvtap.ko: kernel/drivers/net/macvlan.ko kernel/drivers/net/tap.ko\n"
                    .into(),
            ),
            existing_files: vec![
                format!("{DIR}/kernel/drivers/net/macvlan.ko").into(),
                format!("{DIR}/kernel/drivers/net/tap.ko").into(),
                format!("{DIR}/kernel/drivers/net/macvtap.ko").into(),
            ],
            blacklisted_by: vec![],
            sys_module: SysModule::Absent,
            tree_hidden: false,
        }
    }

    #[test]
    fn names_from_paths_ignore_compression_and_dashes() {
        assert_eq!(
            module_name_of("kernel/drivers/net/macvlan.ko.zst"),
            "macvlan"
        );
        assert_eq!(module_name_of("kernel/x/nf-nat.ko.xz"), "nf_nat");
        assert_eq!(module_name_of("macvlan.ko.gz"), "macvlan");
    }

    #[test]
    fn on_disk_not_loaded() {
        assert_eq!(
            detect(&facts(), "macvlan"),
            Detection::NotLoaded {
                path: format!("{DIR}/kernel/drivers/net/macvlan.ko").into(),
                deps: vec![]
            }
        );
    }

    #[test]
    fn dependencies_come_first_in_load_order() {
        let (path, deps) = resolve(
            facts().modules_dep.as_deref().unwrap(),
            Path::new(DIR),
            "macvtap",
        )
        .unwrap();
        assert!(path.ends_with("macvtap.ko"));
        assert_eq!(
            deps,
            vec![
                PathBuf::from(format!("{DIR}/kernel/drivers/net/tap.ko")),
                PathBuf::from(format!("{DIR}/kernel/drivers/net/macvlan.ko"))
            ]
        );
        assert!(matches!(
            detect(&facts(), "macvtap"),
            Detection::NotLoaded { .. }
        ));
    }

    #[test]
    fn loaded_wins_over_everything() {
        let mut f = facts();
        f.proc_modules = Some("macvlan 40960 0 - Live 0x0\n".into());
        f.blacklisted_by = vec!["/etc/modprobe.d/x.conf: blacklist macvlan".into()];
        assert_eq!(detect(&f, "macvlan"), Detection::Loaded);
    }

    #[test]
    fn sysfs_answers_where_proc_modules_is_hidden() {
        let mut f = facts();
        f.proc_modules = None;
        f.tree_hidden = true;
        f.sys_module = SysModule::Live;
        assert_eq!(detect(&f, "macvlan"), Detection::Loaded);
        f.sys_module = SysModule::BuiltIn;
        assert_eq!(detect(&f, "macvlan"), Detection::BuiltIn);
    }

    #[test]
    fn a_hidden_tree_leaves_it_to_the_kernel_and_keeps_the_blacklist() {
        let mut f = facts();
        f.proc_modules = None;
        f.modules_dep = None;
        f.tree_hidden = true;
        f.blacklisted_by = vec!["/etc/modprobe.d/no.conf: blacklist macvlan".into()];
        assert_eq!(
            detect(&f, "macvlan"),
            Detection::Hidden {
                blacklisted_by: f.blacklisted_by.clone()
            }
        );
        // Not the "run depmod" advice a missing modules.dep gets otherwise.
        f.tree_hidden = false;
        f.proc_modules = Some(String::new());
        assert!(matches!(
            detect(&f, "macvlan"),
            Detection::ModuleNotFound { .. }
        ));
    }

    #[test]
    fn builtin_and_no_module_support() {
        let mut f = facts();
        f.modules_builtin = Some("kernel/drivers/net/macvlan.ko\n".into());
        assert_eq!(detect(&f, "macvlan"), Detection::BuiltIn);
        f.proc_modules = None;
        assert_eq!(detect(&f, "macvlan"), Detection::NoModuleSupport);
    }

    #[test]
    fn base_kernel_without_the_module() {
        let mut f = facts();
        f.modules_dep = Some("kernel/drivers/net/veth.ko:\n".into());
        f.existing_files.clear();
        match detect(&f, "macvlan") {
            Detection::ModuleNotFound { detail } => {
                assert!(detail.contains("6.1.0-56-amd64"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn listed_but_missing_file_is_not_found() {
        let mut f = facts();
        f.existing_files.clear();
        assert!(matches!(
            detect(&f, "macvlan"),
            Detection::ModuleNotFound { .. }
        ));
    }

    #[test]
    fn blacklisted_on_disk() {
        let mut f = facts();
        f.blacklisted_by = vec!["/etc/modprobe.d/no.conf: blacklist macvlan".into()];
        assert!(matches!(
            detect(&f, "macvlan"),
            Detection::Blacklisted { .. }
        ));
        // Not on disk at all: the blacklist is not the problem.
        f.modules_dep = Some(String::new());
        assert!(matches!(
            detect(&f, "macvlan"),
            Detection::ModuleNotFound { .. }
        ));
    }
}
