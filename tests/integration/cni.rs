//! `harvester-node-agent check cni` on the rig (issue #32): run in a guest
//! that holds a Service's address, with each symptom faked as the real
//! component leaves it: Calico's and flannel's node address in their Node
//! annotations, a tc BPF filter on our link (Cilium before tcx), and
//! NetworkManager's and systemd-networkd's state files saying they manage
//! it (in a private mount namespace, over a private `/run`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hna_contract::harvester;
use hna_testkit::lb::{self, LISTEN_PORT, LbRig};
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

use crate::harness::tests;

tests! {
    check_cni_finds_each_symptom_as_its_component_leaves_it: Root, Iproute2, Dnsmasq, ApiServer, Socat;
}

/// What RKE2's rke2-canal chart writes (`10-canal.conflist`).
const CANAL_CONFLIST: &str = r#"{
  "name": "k8s-pod-network",
  "cniVersion": "1.0.0",
  "plugins": [
    {"type": "calico", "log_level": "info", "datastore_type": "kubernetes",
     "nodename": "__KUBERNETES_NODE_NAME__", "mtu": 1450,
     "ipam": {"type": "host-local", "subnet": "usePodCidr"},
     "policy": {"type": "k8s"}, "kubernetes": {"kubeconfig": "/etc/cni/net.d/calico-kubeconfig"}},
    {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}},
    {"type": "bandwidth", "capabilities": {"bandwidth": true}}
  ]
}"#;

struct Guest<'a> {
    lb: &'a LbRig,
    index: usize,
    conf_dir: &'a Path,
}

impl Guest<'_> {
    /// `check cni` in the guest's network namespace, in a mount namespace
    /// of its own whose `/run` is a fresh tmpfs prepared by `run_setup`
    /// (shell). Returns the exit code and the JSON report.
    fn check(&self, run_setup: &str) -> Result<(i32, Value)> {
        let kubeconfig = self.lb.agent_kubeconfig(self.index)?;
        let node = self.lb.node_name(self.index);
        let script = format!("mount -t tmpfs tmpfs /run && {{ {run_setup} ; }} && exec \"$@\"");
        let out = Command::new("ip")
            .args(["netns", "exec", self.lb.rig.guest_ns(self.index)])
            .args(["unshare", "--mount", "--propagation", "private", "sh", "-c"])
            .arg(&script)
            .arg("sh")
            .arg(crate::BIN)
            .args(["check", "cni", "--output", "json", "--node-name", &node])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--cni-conf-dir")
            .arg(self.conf_dir)
            .output()
            .context("running check cni")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(&stdout).with_context(|| {
            format!(
                "check cni output: {stdout}\nstderr: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        Ok((out.status.code().unwrap_or(-1), v))
    }

    fn ifindex(&self, link: &str) -> Result<u64> {
        let out = Command::new("ip")
            .args([
                "-n",
                self.lb.rig.guest_ns(self.index),
                "-j",
                "link",
                "show",
                "dev",
                link,
            ])
            .output()?;
        let v: Value = serde_json::from_slice(&out.stdout)?;
        v[0]["ifindex"].as_u64().context("no ifindex")
    }

    fn tc(&self, args: &[&str]) -> Result<()> {
        let st = Command::new("ip")
            .args(["netns", "exec", self.lb.rig.guest_ns(self.index), "tc"])
            .args(args)
            .status()?;
        ensure!(st.success(), "tc {args:?}: {st}");
        Ok(())
    }
}

fn named<'v>(report: &'v Value, name: &str) -> Result<&'v Value> {
    report["checks"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .with_context(|| format!("no {name} check in {report}"))
}

fn expect(report: &(i32, Value), name: &str, status: &str, says: &[&str]) -> Result<()> {
    let (code, v) = report;
    let c = named(v, name)?;
    let text = format!("{} {}", c["message"], c["remediation"]);
    ensure!(
        c["status"] == status && says.iter().all(|s| text.contains(s)),
        "{name}: want {status} saying {says:?}, got {c}"
    );
    let failed = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["status"] == "fail");
    ensure!(
        *code == if failed { 1 } else { 0 },
        "exit code {code} with {v}"
    );
    Ok(())
}

fn annotate_node(lb: &LbRig, node: &str, key: &str, value: Option<&str>) -> Result<()> {
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(lb.admin());
    let patch = json!({"metadata": {"annotations": {key: value}}});
    lb.block_on(nodes.patch(node, &PatchParams::default(), &Patch::Merge(&patch)))?;
    Ok(())
}

fn check_cni_finds_each_symptom_as_its_component_leaves_it() -> Result<()> {
    let lb = LbRig::start(lb::Options::new(
        crate::BIN,
        Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    ))?;
    lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let ip = lb.wait_ingress("web", Duration::from_secs(60));
    let (holder_node, link) = lb
        .carriers(ip)
        .into_iter()
        .next()
        .context("nobody carries the address")?;
    let holder = lb.guest_of(&holder_node);
    let other = (holder + 1) % lb.guests();
    let conf = tempfile::tempdir()?;
    std::fs::write(conf.path().join("10-canal.conflist"), CANAL_CONFLIST)?;
    let guest = Guest {
        lb: &lb,
        index: holder,
        conf_dir: conf.path(),
    };

    // As the rig leaves it: nothing reaches our link.
    let clean = guest.check("true")?;
    expect(&clean, "cni", "ok", &["canal", "10-canal.conflist"])?;
    expect(&clean, "cni-node-address", "ok", &[])?;
    expect(&clean, "cni-bpf", "ok", &["1 hlb-* link"])?;
    expect(&clean, "cni-link-managers", "ok", &[])?;
    let advice = clean.1["helmChartConfigs"].to_string();
    ensure!(
        advice.contains("rke2-canal") && advice.contains("skip-interface=hlb-.*"),
        "{advice}"
    );

    // Calico took the load-balancer address for the node's (its
    // `first-found` method on the holder).
    annotate_node(
        &lb,
        &holder_node,
        "projectcalico.org/IPv4Address",
        Some(&format!("{ip}/24")),
    )?;
    expect(
        &guest.check("true")?,
        "cni-node-address",
        "fail",
        &[&ip.to_string(), &link.name, "HelmChartConfig"],
    )?;
    annotate_node(&lb, &holder_node, "projectcalico.org/IPv4Address", None)?;
    // flannel did, on a node that no longer holds it: the Service is named.
    let elsewhere = Guest {
        index: other,
        ..guest
    };
    let node = lb.node_name(other);
    annotate_node(
        &lb,
        &node,
        "flannel.alpha.coreos.com/public-ip",
        Some(&ip.to_string()),
    )?;
    expect(
        &elsewhere.check("true")?,
        "cni-node-address",
        "fail",
        &["flannel", "default/web"],
    )?;
    annotate_node(&lb, &node, "flannel.alpha.coreos.com/public-ip", None)?;

    // A tc BPF filter on our link, as Cilium attaches one to each device
    // it detects (here classic BPF that accepts all: the traffic goes on).
    guest.tc(&["qdisc", "add", "dev", &link.name, "clsact"])?;
    guest.tc(&[
        "filter",
        "add",
        "dev",
        &link.name,
        "ingress",
        "bpf",
        "bytecode",
        "1,6 0 0 4294967295,",
    ])?;
    let bpf = guest.check("true");
    guest.tc(&["qdisc", "del", "dev", &link.name, "clsact"])?;
    expect(&bpf?, "cni-bpf", "fail", &[&link.name, "tc ingress"])?;

    // NetworkManager's and systemd-networkd's own state files for the link.
    let index = guest.ifindex(&link.name)?;
    let nm = format!(
        "mkdir -p /run/NetworkManager/devices && printf '[device]\\nmanaged=true\\nperm-hw-addr-fake={}\\n' > /run/NetworkManager/devices/{index}",
        link.mac
    );
    expect(
        &guest.check(&nm)?,
        "cni-link-managers",
        "fail",
        &["NetworkManager", "90-harvester-node-agent.conf"],
    )?;
    let networkd = format!(
        "mkdir -p /run/systemd/netif/links && printf '# This is private data. Do not parse.\\nADMIN_STATE=configured\\nOPER_STATE=routable\\nNETWORK_FILE=/etc/systemd/network/99-dhcp.network\\n' > /run/systemd/netif/links/{index}"
    );
    expect(
        &guest.check(&networkd)?,
        "cni-link-managers",
        "fail",
        &["SystemdNetworkd", "99-dhcp.network", "Name=!hlb-*"],
    )?;

    // What every netlink listener on the node (Felix, Cilium,
    // NetworkManager) receives from the address lifetime's refresh:
    // RTM_NEWADDR for the held address, counted over a window.
    let window = Duration::from_secs(5);
    let mut monitor = Command::new("ip")
        .args([
            "-n",
            lb.rig.guest_ns(holder),
            "monitor",
            "address",
            "dev",
            &link.name,
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    std::thread::sleep(window);
    monitor.kill()?;
    let seen = monitor.wait_with_output()?;
    let events = String::from_utf8_lossy(&seen.stdout)
        .lines()
        .filter(|l| l.contains(&ip.to_string()) && !l.starts_with("Deleted"))
        .count();
    let per_second = events as f64 / window.as_secs_f64();
    println!(
        "cni: the lifetime refresh sends {per_second:.1} RTM_NEWADDR per held address and second ({events} in {window:?}, lifetime 1 s)"
    );
    // Four confirmations per lifetime (docs/operations.md, CNI coexistence).
    ensure!(
        (2.0..=6.0).contains(&per_second),
        "{per_second} RTM_NEWADDR per second, four per 1 s lifetime expected"
    );

    // Nothing was changed: the address is still served from its link.
    ensure!(
        lb.carriers(ip)
            .iter()
            .any(|(n, l)| *n == holder_node && l.name == link.name),
        "the address left its link: {:?}",
        lb.carriers(ip)
    );
    Ok(())
}
