//! MetalLB in layer-2 mode, run in the rig as plain processes: its
//! controller (allocates from a static pool, writes the Service's status)
//! in the host's namespace, one speaker per guest (answers ARP for the
//! Services its node was elected for, memberlist between the speakers to
//! notice a dead one).
//!
//! What a cluster adds around a speaker is stood in for by the rig:
//! - its Pods, for memberlist's peer list: Pods `speaker-<node>` labelled
//!   [`SPEAKER_LABELS`] whose `status.podIP` is the node's address (no
//!   kubelet runs; the status is written by the rig);
//! - kube-proxy in IPVS mode, which is what makes a LoadBalancer address
//!   answer TCP on a node: every Service address local to every guest
//!   (kube-proxy puts it on a dummy `kube-ipvs0`; the rig, whose kernel
//!   may lack the dummy driver, on `lo`, the same for ARP and TCP), and
//!   `arp_ignore=1`/`arp_announce=2` so that only the speaker answers ARP
//!   for it ([`MetalLb::route_to_nodes`]). MetalLB puts
//!   no address on any interface: which node holds a Service is what ARP
//!   answers, not a kernel's address list.
//!
//! MetalLB has no DHCP: its addresses come from the pool it is given
//! ([`POOL`], outside the rig's DHCP range).

use std::fs;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Stdio};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::lb::{LbRig, node_address};
use crate::rig::manifests::{self, Mode};
use crate::rig::process::run_args;

pub use crate::locate::peers::METALLB_VERSION;

/// The namespace MetalLB's objects and placeholder Pods live in.
pub const NAMESPACE: &str = "metallb-system";
/// The label selector of the speakers' Pods (memberlist's peer list).
pub const SPEAKER_LABELS: &str = "app=metallb,component=speaker";
/// The addresses MetalLB hands out (outside DHCP's 100–199, the guests'
/// 10–19 and the LAN hosts' 200–254).
pub const POOL: (&str, &str) = ("10.77.0.40", "10.77.0.89");
/// More addresses after [`POOL`] on a rig with a wide LAN
/// ([`crate::lb::Options::wide_lan`]): 200, in [`crate::lb::WIDE_LAN`]
/// beyond its DHCP range.
pub const WIDE_POOL: (&str, &str) = ("10.77.3.0", "10.77.3.199");

/// MetalLB's controller and speakers in a rig. Killed when dropped.
pub struct MetalLb {
    speaker_bin: PathBuf,
    controller_bin: PathBuf,
    speakers: Vec<Option<Child>>,
    controller: Option<Child>,
    logs: PathBuf,
}

impl MetalLb {
    /// Installs MetalLB's CRDs, configuration and placeholder Pods, and
    /// readies every guest (its own address, kube-proxy's part).
    pub fn install(lb: &LbRig) -> Result<MetalLb> {
        let (speaker_bin, controller_bin, crds) =
            crate::locate::peers::metallb().map_err(|what| {
                anyhow::anyhow!("{what}: build and cache it with `{}`", super::INSTALL)
            })?;
        let logs = lb.rig.dir().join("metallb");
        fs::create_dir_all(&logs)?;
        let client = lb.admin();
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": NAMESPACE}}))?;
        lb.block_on(namespaces.create(&PostParams::default(), &ns))
            .context("creating namespace metallb-system")?;
        // No controller-manager makes the namespace's default
        // ServiceAccount, which a Pod needs to be admitted.
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
        let sa: ServiceAccount =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}}))?;
        lb.block_on(accounts.create(&PostParams::default(), &sa))
            .context("creating the default ServiceAccount of metallb-system")?;
        let mut all = Vec::new();
        for entry in fs::read_dir(&crds).with_context(|| format!("{}", crds.display()))? {
            all.extend(manifests::load_file(&entry?.path())?);
        }
        lb.block_on(manifests::apply(&client, &all, Mode::Apply))
            .context("applying MetalLB's CRDs")?;
        let mut pool = vec![format!("\"{}-{}\"", POOL.0, POOL.1)];
        if lb.wide_lan() {
            pool.push(format!("\"{}-{}\"", WIDE_POOL.0, WIDE_POOL.1));
        }
        let config = format!(
            r#"
apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata: {{name: rig, namespace: {NAMESPACE}}}
spec:
  addresses: [{}]
---
apiVersion: metallb.io/v1beta1
kind: L2Advertisement
metadata: {{name: rig, namespace: {NAMESPACE}}}
spec:
  interfaces: [eth0]
"#,
            pool.join(", ")
        );
        let path = logs.join("config.yaml");
        fs::write(&path, config)?;
        let objects = manifests::load_file(&path)?;
        lb.block_on(manifests::apply(&client, &objects, Mode::Apply))
            .context("applying MetalLB's pool and L2Advertisement")?;

        let pods: Api<Pod> = Api::namespaced(client, NAMESPACE);
        let placeholder = |name: &str, labels: serde_json::Value| -> Result<Pod> {
            Ok(serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "labels": labels},
                "spec": {
                    "automountServiceAccountToken": false,
                    "containers": [{"name": "placeholder", "image": "none"}]
                }
            }))?)
        };
        lb.block_on(pods.create(
            &PostParams::default(),
            &placeholder(
                "controller",
                serde_json::json!({"app": "metallb", "component": "controller"}),
            )?,
        ))
        .context("creating the controller's Pod")?;
        for i in 0..lb.rig.guest_namespaces().len() {
            let name = speaker_pod(lb, i);
            lb.block_on(pods.create(
                &PostParams::default(),
                &placeholder(
                    &name,
                    serde_json::json!({"app": "metallb", "component": "speaker"}),
                )?,
            ))
            .with_context(|| format!("creating Pod {name}"))?;
            let ip = node_address(i).to_string();
            let status = serde_json::json!({
                "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
            });
            lb.block_on(pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status)))
                .with_context(|| format!("writing Pod {name}'s address"))?;
            prepare_guest(lb, i)?;
        }
        Ok(MetalLb {
            speaker_bin,
            controller_bin,
            speakers: (0..lb.rig.guest_namespaces().len()).map(|_| None).collect(),
            controller: None,
            logs,
        })
    }

    fn log(&self, name: &str) -> Result<(Stdio, Stdio)> {
        let f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("{name}.log")))?;
        Ok((f.try_clone()?.into(), f.into()))
    }

    /// The tail of a process's log: `controller` or `speaker-<i>`.
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        let text = fs::read_to_string(self.logs.join(format!("{name}.log"))).unwrap_or_default();
        crate::lb::tail(&text, lines)
    }

    /// Starts the controller in the host's namespace (no webhooks, random
    /// metrics and health ports: other rigs may run beside it).
    pub fn start_controller(&mut self, lb: &LbRig) -> Result<()> {
        let api = lb.rig.apiserver().context("API server")?;
        let (out, err) = self.log("controller")?;
        let child = std::process::Command::new(&self.controller_bin)
            .args([
                "--port=0",
                "--health-probe-port=0",
                "--webhook-mode=disabled",
                "--log-level=info",
            ])
            .env("METALLB_NAMESPACE", NAMESPACE)
            .env("METALLB_POD_NAME", "controller")
            .env("KUBECONFIG", api.admin_kubeconfig())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {}", self.controller_bin.display()))?;
        self.controller = Some(child);
        Ok(())
    }

    /// Starts guest `i`'s speaker, memberlist on the guest's address.
    pub fn start_speaker(&mut self, lb: &LbRig, i: usize) -> Result<()> {
        if self.speakers[i].is_some() {
            bail!("a speaker already runs in guest {i}");
        }
        let (out, err) = self.log(&format!("speaker-{i}"))?;
        let child = lb
            .rig
            .netns_cmd(lb.rig.guest_ns(i), &self.speaker_bin)
            .args(["--log-level=info"])
            .env("METALLB_NODE_NAME", lb.node_name(i))
            .env("METALLB_POD_NAME", speaker_pod(lb, i))
            .env("METALLB_NAMESPACE", NAMESPACE)
            .env("METALLB_ML_BIND_ADDR", node_address(i).to_string())
            .env("METALLB_ML_LABELS", SPEAKER_LABELS)
            .env("KUBECONFIG", lb.guest_admin_kubeconfig(i)?)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {}", self.speaker_bin.display()))?;
        self.speakers[i] = Some(child);
        Ok(())
    }

    /// Guest `i`'s speaker's pid, while it runs.
    pub fn speaker_pid(&self, i: usize) -> Option<u32> {
        self.speakers.get(i)?.as_ref().map(|c| c.id())
    }

    /// The controller's pid, while it runs.
    pub fn controller_pid(&self) -> Option<u32> {
        self.controller.as_ref().map(|c| c.id())
    }

    /// The controller and every speaker.
    pub fn start_all(&mut self, lb: &LbRig) -> Result<()> {
        self.start_controller(lb)?;
        for i in 0..self.speakers.len() {
            self.start_speaker(lb, i)?;
        }
        Ok(())
    }

    /// An error with its log's tail for every process that exited.
    pub fn check_running(&mut self) -> Result<()> {
        let mut dead = Vec::new();
        if let Some(st) = super::reap_exited(&mut self.controller) {
            dead.push(format!(
                "MetalLB's controller exited ({st}):\n{}",
                self.log_tail("controller", 30)
            ));
        }
        for i in 0..self.speakers.len() {
            if let Some(st) = super::reap_exited(&mut self.speakers[i]) {
                dead.push(format!(
                    "MetalLB's speaker in guest {i} exited ({st}):\n{}",
                    self.log_tail(&format!("speaker-{i}"), 30)
                ));
            }
        }
        if dead.is_empty() {
            Ok(())
        } else {
            bail!("{}", dead.join("\n"))
        }
    }

    /// Sends `signal` to guest `i`'s speaker and returns at once.
    pub fn signal(&self, i: usize, signal: Signal) {
        if let Some(c) = &self.speakers[i] {
            let _ = kill(Pid::from_raw(c.id() as i32), signal);
        }
    }

    /// Sends `signal` to guest `i`'s speaker and waits (up to 20 s, then
    /// SIGKILL) for it to exit.
    pub fn stop(&mut self, i: usize, signal: Signal) {
        if let Some(child) = self.speakers[i].take() {
            super::stop_child(child, signal, &format!("MetalLB's speaker in guest {i}"));
        }
    }

    /// Guest `i` was deleted with its speaker.
    pub fn forget(&mut self, i: usize) {
        if let Some(c) = self.speakers[i].take() {
            super::kill_now(c);
        }
    }

    /// Kills the controller (MetalLB runs one, without leader election).
    pub fn kill_controller(&mut self) {
        if let Some(c) = self.controller.take() {
            super::kill_now(c);
        }
    }

    /// kube-proxy's part for a Service address: local to every running
    /// guest (on `lo`), as kube-proxy in IPVS mode binds it on every node.
    pub fn route_to_nodes(&self, lb: &LbRig, ip: Ipv4Addr) -> Result<()> {
        for i in 0..self.speakers.len() {
            if self.speakers[i].is_none() {
                continue;
            }
            let ns = lb.rig.guest_ns(i);
            run_args(
                "ip",
                [
                    "-n",
                    ns,
                    "addr",
                    "replace",
                    &format!("{ip}/32"),
                    "dev",
                    "lo",
                ],
            )?;
        }
        Ok(())
    }
}

impl Drop for MetalLb {
    fn drop(&mut self) {
        self.speakers
            .iter_mut()
            .chain(std::iter::once(&mut self.controller))
            .filter_map(Option::take)
            .for_each(super::kill_now);
    }
}

fn speaker_pod(lb: &LbRig, i: usize) -> String {
    format!("speaker-{}", lb.node_name(i))
}

/// Guest `i` as a node of a MetalLB cluster: the ARP settings kube-proxy's
/// IPVS mode sets, so that a node answers ARP only for addresses on the
/// interface asked on (not for the Service addresses on `lo`).
fn prepare_guest(lb: &LbRig, i: usize) -> Result<()> {
    let ns = lb.rig.guest_ns(i);
    for (key, value) in [
        ("net.ipv4.conf.all.arp_ignore", "1"),
        ("net.ipv4.conf.all.arp_announce", "2"),
    ] {
        run_args(
            "ip",
            [
                "netns",
                "exec",
                ns,
                "sysctl",
                "-q",
                "-w",
                &format!("{key}={value}"),
            ],
        )?;
    }
    Ok(())
}
