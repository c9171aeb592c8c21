//! modprobe.d and modules-load.d configuration as it concerns one module:
//! is it disabled (blacklisted), and is it loaded at boot.
//!
//! `modprobe macvlan` by explicit name ignores `blacklist` lines (they only
//! stop loading by alias), so the agent checks them itself and refuses.

use std::path::{Path, PathBuf};

use super::detect::normalize;

/// Directories in precedence order (a file name in an earlier directory
/// hides the same name in later ones, as in modprobe.d(5)).
pub(crate) const MODPROBE_D: &[&str] = &[
    "/etc/modprobe.d",
    "/run/modprobe.d",
    "/usr/local/lib/modprobe.d",
    "/usr/lib/modprobe.d",
    "/lib/modprobe.d",
];

pub(crate) const MODULES_LOAD_D: &[&str] = &[
    "/etc/modules-load.d",
    "/run/modules-load.d",
    "/usr/local/lib/modules-load.d",
    "/usr/lib/modules-load.d",
    "/lib/modules-load.d",
];

/// Commands that turn `install <module> <cmd>` into "never load".
const DISABLING_INSTALL: &[&str] = &[
    "/bin/false",
    "/bin/true",
    "/usr/bin/false",
    "/usr/bin/true",
    "false",
    "true",
];

/// Blacklist entries for `module` in one modprobe.d file's text.
pub(crate) fn blacklist_lines(file: &Path, text: &str, module: &str) -> Vec<String> {
    let module = normalize(module);
    let mut hits = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let (Some(cmd), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if normalize(name) != module {
            continue;
        }
        let disabled = match cmd {
            "blacklist" => true,
            "install" => words.next().is_some_and(|c| DISABLING_INSTALL.contains(&c)),
            _ => false,
        };
        if disabled {
            hits.push(format!("{}: {line}", file.display()));
        }
    }
    hits
}

/// Blacklist entries on the kernel command line (`modprobe.blacklist=` is
/// honoured by modprobe, `module_blacklist=` by the kernel itself).
pub(crate) fn cmdline_blacklist(cmdline: &str, module: &str) -> Vec<String> {
    let module = normalize(module);
    cmdline
        .split_whitespace()
        .filter_map(|arg| {
            let (key, value) = arg.split_once('=')?;
            matches!(key, "modprobe.blacklist" | "module_blacklist")
                .then_some(())
                .filter(|_| value.split(',').any(|m| normalize(m) == module))
                .map(|_| format!("/proc/cmdline: {arg}"))
        })
        .collect()
}

/// Whether a modules-load.d file's text lists the module.
pub(crate) fn lists_module(text: &str, module: &str) -> bool {
    let module = normalize(module);
    text.lines()
        .map(|l| l.split(['#', ';']).next().unwrap_or("").trim())
        .any(|l| normalize(l) == module)
}

/// `*.conf` files of `dirs`, with earlier directories hiding same-named files
/// in later ones; sorted by file name as modprobe and systemd read them.
pub(crate) fn conf_files(dirs: &[&str], root: &Path) -> Vec<PathBuf> {
    let mut by_name: std::collections::BTreeMap<String, PathBuf> = Default::default();
    for dir in dirs {
        let dir = root.join(dir.trim_start_matches('/'));
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.ends_with(".conf") {
                by_name.entry(name).or_insert_with(|| e.path());
            }
        }
    }
    by_name.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blacklist_and_disabling_install_count() {
        let f = Path::new("/etc/modprobe.d/x.conf");
        let text = "# comment\nblacklist macvlan\ninstall macvlan /bin/false\ninstall macvlan /sbin/modprobe --ignore-install macvlan\nblacklist veth\noptions macvlan x=1\n";
        let hits = blacklist_lines(f, text, "macvlan");
        assert_eq!(hits.len(), 2, "{hits:?}");
        assert!(hits[0].starts_with("/etc/modprobe.d/x.conf: blacklist macvlan"));
        assert!(blacklist_lines(f, "blacklist mac-vlan\n", "mac_vlan").len() == 1);
        assert!(blacklist_lines(f, "blacklist macvlan_extra\n", "macvlan").is_empty());
    }

    #[test]
    fn kernel_command_line() {
        assert_eq!(
            cmdline_blacklist(
                "quiet modprobe.blacklist=floppy,macvlan root=/dev/vda",
                "macvlan"
            )
            .len(),
            1
        );
        assert_eq!(
            cmdline_blacklist("module_blacklist=macvlan", "macvlan").len(),
            1
        );
        assert!(cmdline_blacklist("modprobe.blacklist=floppy", "macvlan").is_empty());
    }

    #[test]
    fn modules_load_d_listing() {
        assert!(lists_module("# at boot\nmacvlan\n", "macvlan"));
        assert!(!lists_module("#macvlan\nveth\n", "macvlan"));
    }

    #[test]
    fn earlier_directories_hide_later_files() {
        let root = tempfile::tempdir().unwrap();
        for (dir, body) in [
            ("etc/modprobe.d", "# emptied by admin\n"),
            ("usr/lib/modprobe.d", "blacklist macvlan\n"),
        ] {
            std::fs::create_dir_all(root.path().join(dir)).unwrap();
            std::fs::write(root.path().join(dir).join("net.conf"), body).unwrap();
        }
        std::fs::write(root.path().join("usr/lib/modprobe.d/other.conf"), "").unwrap();
        let files = conf_files(MODPROBE_D, root.path());
        assert_eq!(files.len(), 2);
        assert!(files[0].ends_with("etc/modprobe.d/net.conf"));
    }
}
