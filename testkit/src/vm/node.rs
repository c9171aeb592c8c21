//! A Kubernetes node as a real VM: Debian's kernel under QEMU with the
//! agent inside, one NIC (virtio-net, or an e1000e as older templates
//! have) on a tap of a "host" bridge of the rig's LAN, and a QMP monitor
//! through which the test acts as the hypervisor: live migration to a
//! second QEMU on another host bridge, pause and resume.
//!
//! The guest is the initramfs of [`super::Initramfs`] with the NIC's
//! driver, `macvlan` and `af_packet`, the agent binary, its configuration
//! and node credentials. Its `/init` brings `eth0` up with a static
//! address on the LAN (the node's own address; the agent's LoadBalancer
//! addresses come from the LAN's DHCP server like a namespace guest's),
//! starts two listeners (port [`HELLO_PORT`] answers the node's name,
//! port [`ECHO_PORT`] echoes, for a connection that lives across a
//! migration) and runs the agent in the foreground, its log on the serial
//! console. Nothing in the guest reports on itself for the test: the test
//! looks from the LAN (ARP, TCP) and the API server.
//!
//! A migration's target is the same kernel, initramfs and devices started
//! with `-incoming`, as KubeVirt starts the target virt-launcher.

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use super::qmp::Qmp;
use super::{Initramfs, Kernel, require_program};

/// The guest's listener that answers every connection with its node name.
pub const HELLO_PORT: u16 = 8080;
/// The guest's echo listener.
pub const ECHO_PORT: u16 = 9090;
/// Printed on the console once the agent has been started.
pub const AGENT_STARTED: &str = "@@HNA agent.started";

/// The NIC the VM has, as QEMU names the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NicModel {
    /// `virtio-net-pci`: negotiates `VIRTIO_NET_F_GUEST_ANNOUNCE`, so the
    /// guest kernel announces its addresses after a migration.
    VirtioNet,
    /// `e1000e`, of the e1000 family that older VM templates choose: QEMU
    /// sends only a RARP for the NIC's own MAC, and nothing in the guest
    /// learns of a migration.
    E1000e,
}

impl NicModel {
    fn device(self) -> &'static str {
        match self {
            NicModel::VirtioNet => "virtio-net-pci",
            // Not the plain e1000: under TCG here its guests heard their
            // LAN late or not at all in 2 of 8 boots (their agent fenced
            // over and over and got no lease), with QEMU's interrupt
            // mitigation on or off.
            NicModel::E1000e => "e1000e",
        }
    }

    /// The guest's driver modules, in load order (virtio-net needs the
    /// PCI transport, which `modules.dep` does not list).
    fn modules(self) -> &'static [&'static str] {
        match self {
            NicModel::VirtioNet => &["virtio_pci", "virtio_net"],
            NicModel::E1000e => &["e1000e"],
        }
    }
}

/// What the guest is.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub node_name: String,
    /// The agent binary (stripped into the image).
    pub bin: PathBuf,
    /// Node credentials whose server the VM reaches on the LAN.
    pub kubeconfig: PathBuf,
    /// The agent's `config.toml`.
    pub agent_config: String,
    /// `eth0`'s address (a /24 on the LAN) and default gateway.
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    /// `eth0`'s MAC; a migration's target has the same.
    pub mac: String,
    pub nic: NicModel,
    pub memory_mb: u32,
    /// More files in the guest (path, content; mode 0600): the Harvester
    /// cloud-provider kubeconfig at `/etc/kubernetes/cloud-config`, where
    /// the agent's topology relay looks for it.
    pub files: Vec<(String, Vec<u8>)>,
}

/// A packed guest image; the files live as long as it does.
pub struct NodeImage {
    _staging: Initramfs,
    _dir: tempfile::TempDir,
    initramfs: PathBuf,
}

/// Builds the guest image of `spec`.
pub fn node_image(kernel: &Kernel, spec: &NodeSpec) -> Result<NodeImage> {
    let dir = tempfile::Builder::new().prefix("hna-vmnode-").tempdir()?;
    let mut img = Initramfs::new(kernel)?;
    img.add_binary(
        &super::stripped_binary(&spec.bin, dir.path())?,
        "/usr/bin/harvester-node-agent",
    )?;
    img.add_modules(spec.nic.modules())?;
    img.add_modules(&["macvlan", "af_packet"])?;
    img.add_file(
        "/etc/harvester-node-agent/config.toml",
        spec.agent_config.as_bytes(),
        0o644,
    )?;
    let kubeconfig = fs::read(&spec.kubeconfig)
        .with_context(|| format!("reading {}", spec.kubeconfig.display()))?;
    img.add_file("/etc/harvester-node-agent/kubeconfig", &kubeconfig, 0o600)?;
    for (path, content) in &spec.files {
        img.add_file(path, content, 0o600)?;
    }
    img.add_file(
        "/hna/hello.sh",
        format!("#!/bin/sh\necho {}\n", spec.node_name).as_bytes(),
        0o755,
    )?;
    img.set_init(&format!(
        r#"
hostname {node}
for m in {nic} macvlan af_packet; do modprobe $m; done
i=0; while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
ip link set eth0 up
ip addr add {addr}/24 dev eth0
ip route add default via {gw}
# As systemd and the kubelet have it: the agent in a cgroup of its own,
# the tenant's listeners (a process forked per connection) in another.
mkdir -p /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo +cpu > /sys/fs/cgroup/cgroup.subtree_control
mkdir /sys/fs/cgroup/workload /sys/fs/cgroup/agent
echo $$ > /sys/fs/cgroup/workload/cgroup.procs
nc -ll -p {hello} -e /hna/hello.sh &
nc -ll -p {echo} -e cat &
echo $$ > /sys/fs/cgroup/agent/cgroup.procs
mkdir -p /run/harvester-node-agent /var/lib/harvester-node-agent
echo "{started} $(cut -d' ' -f1 /proc/uptime)"
HNA_LOG_TARGET=stderr HNA_KUBECONFIG_SEARCH= RUST_LOG=info,harvester_node_agent=debug \
  /usr/bin/harvester-node-agent run --config /etc/harvester-node-agent/config.toml \
  --node-name {node} --kubeconfig /etc/harvester-node-agent/kubeconfig \
  --credentials-retry 1s 2>&1
hna agent.exit $?
"#,
        node = spec.node_name,
        nic = spec.nic.modules().join(" "),
        addr = spec.address,
        gw = spec.gateway,
        hello = HELLO_PORT,
        echo = ECHO_PORT,
        started = AGENT_STARTED,
    ));
    let initramfs = img.build()?;
    Ok(NodeImage {
        _staging: img,
        _dir: dir,
        initramfs,
    })
}

/// Where a QEMU process runs: its tap is made in `netns` and joined to
/// `bridge` there (a "host" of the LAN).
#[derive(Debug, Clone)]
pub struct Host {
    pub netns: String,
    pub bridge: String,
    /// The tap's name (unique in `netns`).
    pub tap: String,
}

/// One QEMU process of a VM node; killed when dropped (its tap goes with
/// it). A test with VM nodes holds the VM turn ([`super::turn`]) for its
/// whole run: a migration needs two QEMU processes at once.
pub struct VmNode {
    child: Child,
    qmp: Qmp,
    host: Host,
    pub dir: PathBuf,
    pub console: PathBuf,
    pub started: Instant,
}

impl VmNode {
    /// Starts QEMU for `spec` on `host`, files in `dir` (console, monitor
    /// socket, QEMU's log). With `incoming`, it waits for a migration on
    /// that unix socket instead of booting.
    pub fn start(
        kernel: &Kernel,
        image: &NodeImage,
        spec: &NodeSpec,
        host: &Host,
        dir: &Path,
        incoming: Option<&Path>,
    ) -> Result<VmNode> {
        let qemu = require_program("qemu-system-x86_64")?;
        fs::create_dir_all(dir)?;
        let console = dir.join("console.log");
        let monitor = dir.join("qmp.sock");
        let _ = fs::remove_file(&monitor);
        for p in [&console, &monitor, &image.initramfs] {
            if p.to_string_lossy().contains(',') {
                bail!("qemu cannot take a path with a comma: {}", p.display());
            }
        }
        let ip = |args: &[&str]| -> Result<()> {
            let out = Command::new("ip")
                .args(["-n", &host.netns])
                .args(args)
                .output()?;
            if !out.status.success() {
                bail!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            Ok(())
        };
        let _ = ip(&["link", "del", &host.tap]);
        ip(&["tuntap", "add", "dev", &host.tap, "mode", "tap"])?;
        ip(&["link", "set", &host.tap, "master", &host.bridge])?;
        ip(&["link", "set", &host.tap, "up"])?;

        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &host.netns]).arg(&qemu);
        cmd.args(super::qemu::machine_args(spec.memory_mb))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", monitor.display()))
            .arg("-serial")
            .arg(format!("file:{}", console.display()))
            .arg("-kernel")
            .arg(&kernel.vmlinuz)
            .arg("-initrd")
            .arg(&image.initramfs)
            .args(["-append", "console=ttyS0 panic=-1 quiet loglevel=3"])
            .arg("-netdev")
            .arg(format!(
                "tap,id=n0,ifname={},script=no,downscript=no",
                host.tap
            ))
            .arg("-device")
            .arg(format!("{},netdev=n0,mac={}", spec.nic.device(), spec.mac));
        if let Some(sock) = incoming {
            cmd.arg("-incoming").arg(format!("unix:{}", sock.display()));
        }
        let log = fs::File::create(dir.join("qemu.log"))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        super::qemu::die_with_parent(&mut cmd);
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", qemu.display()))?;
        let qmp = match Qmp::connect(&monitor, started + Duration::from_secs(30)) {
            Ok(q) => q,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e.context(format!(
                    "qemu: {}",
                    fs::read_to_string(dir.join("qemu.log")).unwrap_or_default()
                )));
            }
        };
        Ok(VmNode {
            child,
            qmp,
            host: host.clone(),
            dir: dir.to_path_buf(),
            console,
            started,
        })
    }

    /// The monitor, to pause (`stop`), resume (`cont`) and so on.
    pub fn qmp(&mut self) -> &mut Qmp {
        &mut self.qmp
    }

    /// The host this process runs on.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// The serial console so far (`\r` removed).
    pub fn console_text(&self) -> String {
        fs::read(&self.console)
            .map(|b| String::from_utf8_lossy(&b).replace('\r', ""))
            .unwrap_or_default()
    }

    /// The last `n` lines of the console.
    pub fn console_tail(&self, n: usize) -> String {
        let text = self.console_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Waits until the console has a line containing `needle`, QEMU exits,
    /// or `deadline`.
    pub fn wait_console(&mut self, needle: &str, deadline: Instant) -> Result<()> {
        loop {
            if self.console_text().contains(needle) {
                return Ok(());
            }
            if let Some(st) = self.child.try_wait()? {
                bail!(
                    "qemu exited ({st}) before the console said {needle:?}:\n{}",
                    self.console_tail(40)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the console did not say {needle:?} in time:\n{}",
                    self.console_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Live-migrates this VM into `target` (started with `incoming` =
    /// `socket`) and waits until the migration completed or failed, or
    /// `deadline`. The source is left paused (`postmigrate`) and the target
    /// running, as QEMU leaves them; the caller kills the source.
    pub fn migrate_to(
        &mut self,
        target: &mut VmNode,
        socket: &Path,
        deadline: Instant,
    ) -> Result<Migration> {
        let began = Instant::now();
        self.qmp.execute(
            "migrate",
            json!({"uri": format!("unix:{}", socket.display())}),
        )?;
        loop {
            let info = self.qmp.execute("query-migrate", json!({}))?;
            match info["status"].as_str().unwrap_or("") {
                "completed" => {
                    // The target resumes on its own once it has the state.
                    let resumed = wait_for_status(&mut target.qmp, "running", deadline)?;
                    return Ok(Migration {
                        began,
                        resumed,
                        downtime: info["downtime"].as_u64().map(Duration::from_millis),
                        total: info["total-time"].as_u64().map(Duration::from_millis),
                    });
                }
                "failed" | "cancelled" => bail!("migration {}: {info}", info["status"]),
                _ => {}
            }
            if Instant::now() > deadline {
                let _ = self.qmp.execute("migrate_cancel", json!({}));
                bail!("migration not done in time: {info}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills QEMU (the VM vanishes from the LAN at once) and removes its
    /// tap.
    pub fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = Command::new("ip")
            .args(["-n", &self.host.netns, "link", "del", &self.host.tap])
            .output();
    }
}

impl Drop for VmNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A live migration, as the source's monitor reported it.
#[derive(Debug, Clone)]
pub struct Migration {
    /// When `migrate` was sent.
    pub began: Instant,
    /// When the target was seen running (the switchover, to within the
    /// polling of its monitor).
    pub resumed: Instant,
    /// QEMU's own figures of the guest's downtime and the whole
    /// migration (`None` when its answer had none).
    pub downtime: Option<Duration>,
    pub total: Option<Duration>,
}

/// Polls `query-status` until the VM's status is `want`; returns when it
/// was seen.
fn wait_for_status(qmp: &mut Qmp, want: &str, deadline: Instant) -> Result<Instant> {
    loop {
        let st = qmp.execute("query-status", json!({}))?;
        if st["status"].as_str() == Some(want) {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("the VM is {} not {want}", st["status"]);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
