//! Self-test of the VM harness (`hna_testkit::vm`): boots Debian's stock kernel
//! and shows that `macvlan` there is a module that is not loaded at boot,
//! that creating a macvlan then fails exactly like in the field
//! ("Operation not supported") when the kernel cannot load it by itself,
//! that the kernel loads it by itself (`request_module`) when its modprobe
//! helper works, and that `modprobe macvlan` loads it.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use hna_testkit::vm;

use crate::harness::tests;

tests! {
    macvlan_is_a_module_that_modprobe_loads: Root, Qemu, VmKernel, Iproute2;
    marker_parser;
    version_order;
}

const SCRIPT: &str = r#"
loaded() { if grep -q '^macvlan ' /proc/modules; then echo yes; else echo no; fi; }
add_macvlan() { ip link add link v0 name mv0 type macvlan mode bridge; }

hna release "$(uname -r)"
hna os "$(. /etc/os-release; echo "$ID $VERSION_ID")"
hna modprobe_path "$(cat /proc/sys/kernel/modprobe)"
hna mounts $(while read -r dev dir rest; do echo "$dir"; done </proc/mounts)
hna lo "$(cat /sys/class/net/lo/operstate)"
hna loaded.start "$(loaded)"
hna_run on_disk modinfo -F filename macvlan

hna_run veth.modprobe modprobe veth
hna_run veth.add ip link add v0 type veth peer name v1

# 1. The kernel cannot load modules by itself (empty kernel.modprobe): the
#    field symptom.
echo > /proc/sys/kernel/modprobe
hna_run noauto ip link add link v0 name mv0 type macvlan mode bridge
hna_run noauto.busybox busybox ip link add link v0 name mv0 type macvlan mode bridge
hna loaded.noauto "$(loaded)"

# 2. The kernel's helper is /sbin/modprobe (kmod), as on a real node:
#    request_module("rtnl-link-macvlan") loads the module on demand.
echo /sbin/modprobe > /proc/sys/kernel/modprobe
hna_run auto add_macvlan
hna loaded.auto "$(loaded)"
ip link del mv0 2>/dev/null
hna_run rmmod rmmod macvlan
hna loaded.rmmod "$(loaded)"

# 3. Explicit modprobe, with on-demand loading off again, so only it can have
#    loaded the module.
echo > /proc/sys/kernel/modprobe
hna_run fail_again add_macvlan
hna_run modprobe modprobe macvlan
hna loaded.modprobe "$(loaded)"
hna_run sys_module ls /sys/module/macvlan
hna initstate "$(cat /sys/module/macvlan/initstate)"
hna_run add add_macvlan
hna_run show ip -d -o link show mv0
"#;

fn macvlan_is_a_module_that_modprobe_loads() -> Result<()> {
    let kernel = vm::kernel()?;
    let mut image = vm::Initramfs::new(&kernel)?;
    image.add_modules(&["macvlan", "veth"])?;
    // iproute2 rather than busybox `ip`, as on a real node.
    image.add_binary(Path::new("/usr/sbin/ip"), "/usr/bin/ip")?;
    image.set_init(SCRIPT);
    let initramfs = image.build()?;
    let run = vm::boot(&kernel, &initramfs, &vm::VmOptions::default())?;
    eprintln!(
        "VM ({}) booted, ran the script and powered off in {:.1?}",
        kernel.release, run.duration
    );
    eprintln!("--- console ---\n{}\n--- end ---", run.console);

    let m = |key: &str| run.marker(key).unwrap_or_else(|| panic!("no marker {key}"));
    let out = |key: &str| run.markers(&format!("{key}.out")).join("\n");
    assert_eq!(run.script_status(), Some(0));
    assert_eq!(m("release"), kernel.release);
    assert_eq!(m("os"), "debian 12");
    assert_eq!(m("modprobe_path"), "/sbin/modprobe");
    let mounts: Vec<String> = m("mounts").split(' ').map(str::to_string).collect();
    for dir in [
        "/proc",
        "/sys",
        "/dev",
        "/dev/pts",
        "/sys/kernel/debug",
        "/run",
        "/tmp",
    ] {
        assert!(
            mounts.iter().any(|m| m == dir),
            "{dir} not mounted: {mounts:?}"
        );
    }
    assert_eq!(
        m("lo"),
        "unknown",
        "lo is up (operstate of loopback is `unknown`)"
    );
    assert_eq!(
        m("loaded.start"),
        "no",
        "macvlan must not be loaded at boot"
    );
    assert_eq!(m("on_disk.rc"), "0");
    assert!(
        out("on_disk").ends_with("kernel/drivers/net/macvlan.ko"),
        "{}",
        out("on_disk")
    );
    assert_eq!(m("veth.modprobe.rc"), "0", "{}", out("veth.modprobe"));
    assert_eq!(m("veth.add.rc"), "0", "{}", out("veth.add"));

    // 1. The field symptom.
    assert_ne!(m("noauto.rc"), "0");
    assert!(
        out("noauto").contains("Unknown device type"),
        "{}",
        out("noauto")
    );
    assert_ne!(m("noauto.busybox.rc"), "0");
    assert!(
        out("noauto.busybox").contains("Operation not supported"),
        "{}",
        out("noauto.busybox")
    );
    assert_eq!(m("loaded.noauto"), "no");

    // 2. On-demand loading by the kernel.
    assert_eq!(m("auto.rc"), "0", "{}", out("auto"));
    assert_eq!(m("loaded.auto"), "yes");
    assert_eq!(m("rmmod.rc"), "0", "{}", out("rmmod"));
    assert_eq!(m("loaded.rmmod"), "no");

    // 3. modprobe.
    assert_ne!(m("fail_again.rc"), "0");
    assert_eq!(m("modprobe.rc"), "0", "{}", out("modprobe"));
    assert_eq!(m("loaded.modprobe"), "yes");
    assert_eq!(m("sys_module.rc"), "0");
    assert!(
        out("sys_module").lines().any(|l| l == "initstate"),
        "{}",
        out("sys_module")
    );
    assert_eq!(m("initstate"), "live");
    assert_eq!(m("add.rc"), "0", "{}", out("add"));
    assert!(
        out("show").contains("macvlan mode bridge"),
        "{}",
        out("show")
    );
    Ok(())
}

fn marker_parser() {
    let run = vm::VmRun {
        console: [
            "[    1.234] some kernel line",
            "@@HNA-BEGIN 1.50",
            "@@HNA release 6.1.0-56-amd64",
            "@@HNA add.out Error: Unknown device type.",
            "@@HNA add.rc 2",
            "[    2.000] kernel: noise@@HNA add.out second line  ",
            "@@HNA empty",
            "@@HNA  spaced",
            "@@HNAX not a marker",
            "@@HNA-EXIT 0",
            "@@HNA-END",
        ]
        .join("\n"),
        duration: Duration::from_secs(1),
        completed: true,
    };
    assert_eq!(run.marker("release").as_deref(), Some("6.1.0-56-amd64"));
    assert_eq!(
        run.markers("add.out"),
        ["Error: Unknown device type.", "second line"]
    );
    assert_eq!(run.marker("add.rc").as_deref(), Some("2"));
    assert_eq!(run.marker("empty").as_deref(), Some(""));
    assert_eq!(run.marker("missing"), None);
    assert_eq!(run.marker("add"), None);
    assert_eq!(run.markers("").len(), 1, "`@@HNA  spaced` has an empty key");
    assert_eq!(run.marker("spaced"), None);
    assert_eq!(run.script_status(), Some(0));
    assert_eq!(run.tail(2), "@@HNA-EXIT 0\n@@HNA-END");
}

fn version_order() {
    use std::cmp::Ordering::*;
    assert_eq!(vm::version_cmp("6.1.99-1", "6.1.192-2"), Less);
    assert_eq!(vm::version_cmp("6.1.192-2", "6.1.192-2"), Equal);
    assert_eq!(vm::version_cmp("6.1.192-10", "6.1.192-2"), Greater);
    assert_eq!(vm::version_cmp("6.1.192-2", "6.1.192"), Greater);
}
