//! What to do when the kernel has no macvlan, per distribution.

/// The parts of `/etc/os-release` that pick a remedy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OsRelease {
    pub(crate) id: String,
    pub(crate) id_like: Vec<String>,
    pub(crate) pretty_name: String,
}

impl OsRelease {
    pub(crate) fn parse(text: &str) -> Self {
        let mut os = OsRelease::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            let value = value
                .trim()
                .trim_matches('"')
                .trim_matches('\'')
                .to_string();
            match key.trim() {
                "ID" => os.id = value.to_ascii_lowercase(),
                "ID_LIKE" => {
                    os.id_like = value
                        .split_whitespace()
                        .map(|s| s.to_ascii_lowercase())
                        .collect()
                }
                "PRETTY_NAME" => os.pretty_name = value,
                _ => {}
            }
        }
        os
    }

    fn is(&self, family: &str) -> bool {
        self.id.contains(family) || self.id_like.iter().any(|l| l.contains(family))
    }
}

/// The package that should have carried the module, and the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Remedy {
    pub(crate) package: String,
    pub(crate) remediation: String,
}

pub(crate) fn module_not_found(os: &OsRelease, release: &str) -> Remedy {
    if os.is("suse") || os.id.starts_with("sle") {
        Remedy {
            package: "kernel-default-base".into(),
            remediation: format!(
                "this image's kernel {release} comes from kernel-default-base, which lacks macvlan (Harvester issue #6418). Install the full kernel: `zypper --non-interactive in kernel-default` (it replaces kernel-default-base) and reboot; for kiwi-built images put <package name=\"kernel-default\"/> instead of kernel-default-base in the image description"
            ),
        }
    } else if os.id == "ubuntu" || os.is("ubuntu") {
        Remedy {
            package: format!("linux-modules-{release}"),
            remediation: format!(
                "install the modules of the running kernel: `apt-get install linux-modules-{release}` (kernels of the -kvm flavour carry no macvlan: switch to linux-virtual), then `systemctl reload harvester-node-agent`"
            ),
        }
    } else if os.is("debian") {
        Remedy {
            package: format!("linux-image-{release}"),
            remediation: format!(
                "macvlan ships in linux-image-{release}: `apt-get install --reinstall linux-image-{release}`, then `systemctl reload harvester-node-agent`"
            ),
        }
    } else if os.is("rhel") || os.is("fedora") || os.is("centos") {
        Remedy {
            package: format!("kernel-modules-{release}"),
            remediation: format!(
                "install the modules of the running kernel: `dnf install kernel-modules-{release}`, then `systemctl reload harvester-node-agent`"
            ),
        }
    } else {
        Remedy {
            package: "the kernel's module package".into(),
            remediation: format!(
                "install the package that carries macvlan.ko for kernel {release} (or a kernel built with CONFIG_MACVLAN), then `systemctl reload harvester-node-agent`"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suse_images_get_kernel_default() {
        let os = OsRelease::parse(
            "NAME=\"SLES\"\nID=\"sles\"\nID_LIKE=\"suse\"\nPRETTY_NAME=\"SUSE Linux Enterprise Server 15 SP5\"\n",
        );
        let r = module_not_found(&os, "5.14.21-150500.55.19-default");
        assert_eq!(r.package, "kernel-default-base");
        assert!(
            r.remediation
                .contains("zypper --non-interactive in kernel-default")
        );
        assert!(r.remediation.contains("5.14.21-150500.55.19-default"));
        let leap = OsRelease::parse("ID=\"opensuse-leap\"\nID_LIKE=\"suse opensuse\"\n");
        assert_eq!(module_not_found(&leap, "x").package, "kernel-default-base");
    }

    #[test]
    fn debian_and_ubuntu_name_their_packages() {
        let deb = OsRelease::parse("ID=debian\n");
        assert_eq!(
            module_not_found(&deb, "6.1.0-56-amd64").package,
            "linux-image-6.1.0-56-amd64"
        );
        let ubu = OsRelease::parse("ID=ubuntu\nID_LIKE=debian\n");
        assert_eq!(
            module_not_found(&ubu, "6.8.0-31-generic").package,
            "linux-modules-6.8.0-31-generic"
        );
    }
}
