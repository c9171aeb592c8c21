//! The README's demo (`sudo tests/demo.sh`): the whole story of a DHCP
//! LoadBalancer Service on the local rig. A DHCP LAN (dnsmasq), three
//! guest-VM network namespaces and a client namespace on it, a real
//! kube-apiserver with `packaging/kubernetes/` applied, the node agent in
//! every guest (node credentials) and two controller replicas (the
//! manifests' ServiceAccount). A Service gets an address held by one node,
//! a TCP request from the client through it succeeds, the listing shows
//! which node holds it, and deleting the Service releases the lease.
//!
//! `--hold` keeps everything running until Ctrl-C. Everything is torn down
//! at the end, also on error.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, annotation, wait_for};
use hna_testkit::rig;

fn status_json(agent: &Path, socket: &Path) -> Result<serde_json::Value> {
    let out = Command::new(agent)
        .args(["status", "--output", "json", "--socket"])
        .arg(socket)
        .output()?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn main() -> Result<()> {
    // The one tests/demo.sh builds (the dev profile).
    let mut agent = PathBuf::from("target/debug/harvester-node-agent");
    let mut hold = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--agent" => agent = args.next().context("--agent needs a path")?.into(),
            "--hold" => hold = true,
            "-h" | "--help" => {
                println!("usage: demo [--agent PATH] [--hold]");
                return Ok(());
            }
            other => bail!("unknown argument {other}; usage: demo [--agent PATH] [--hold]"),
        }
    }
    let agent = std::fs::canonicalize(&agent)
        .with_context(|| format!("agent binary {} (build it first)", agent.display()))?;
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");

    println!("== harvester-node-agent demo ==");
    let t0 = Instant::now();
    let lb = LbRig::start(lb::Options::new(&agent, &manifests))?;
    let api = lb.rig.apiserver().context("API server")?;
    println!(
        "rig {} up in {:.1}s (all traffic stays in its namespaces and on loopback):",
        lb.rig.id(),
        t0.elapsed().as_secs_f64()
    );
    println!(
        "  LAN        namespace {} : bridge br0 {}/24, dnsmasq serving {}-{}",
        lb.rig.lan_ns(),
        rig::LAN_ADDR,
        rig::DHCP_FIRST,
        rig::DHCP_LAST
    );
    for i in 0..lb.rig.guest_count() {
        println!(
            "  guest VM   namespace {} : eth0 on br0, node {}, agent with system:node:{} credentials",
            lb.rig.guest_ns(i),
            lb.node_name(i),
            lb.node_name(i)
        );
    }
    println!(
        "  client     namespace {} : a host on the LAN",
        lb.client_ns
    );
    println!(
        "  API server {} : kube-apiserver {} + etcd, Node,RBAC authorization;",
        api.url(),
        api.version()
    );
    println!(
        "             packaging/kubernetes applied; 2 controller replicas as its ServiceAccount"
    );

    println!("\nagents report themselves ready in their LoadBalancerNode objects:");
    for i in 0..lb.rig.guest_count() {
        let node = lb.node_name(i);
        wait_for(Duration::from_secs(60), || {
            let v = lb.node_object(&node)?;
            (v["status"]["ready"] == true).then_some(())
        })
        .with_context(|| format!("{node} never reported ready; its log:\n{}", lb.agent_log(i)))?;
        let st = status_json(&agent, &lb.agent_socket(i))?;
        println!("  {node:<10} {}", st["summary"].as_str().unwrap_or("?"));
    }
    let leader =
        wait_for(Duration::from_secs(30), || lb.leader()).context("no controller leads")?;
    println!(
        "  controller leader (Lease {}): {leader}",
        lb::CONTROLLER_LEASE
    );

    println!(
        "\n`harvester-node-agent dhcp-probe` in {}: the VM network's DHCP checked before any Service exists",
        lb.node_name(0)
    );
    let out = lb
        .rig
        .netns_cmd(lb.rig.guest_ns(0), &agent)
        .args(["dhcp-probe", "--parent", "eth0"])
        .output()?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        println!("  {line}");
    }
    if !out.status.success() {
        bail!(
            "dhcp-probe failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    println!(
        "\nkubectl create service web: type LoadBalancer, cloudprovider.harvesterhci.io/ipam: dhcp, port {LISTEN_PORT}"
    );
    let created = Instant::now();
    lb.create_service(
        "web",
        &[("cloudprovider.harvesterhci.io/ipam", "dhcp")],
        &[LISTEN_PORT],
    )?;
    let ip = lb.wait_ingress("web", Duration::from_secs(60));
    let svc = lb.service("web").context("Service web")?;
    let holder = annotation(&svc, "kube-vip.io/vipHost")
        .unwrap_or("?")
        .to_string();
    println!(
        "  status.loadBalancer.ingress: {ip} after {} ms, held by {holder}",
        created.elapsed().as_millis()
    );
    for key in [
        "kube-vip.io/hwaddr",
        "kube-vip.io/requestedIP",
        "kube-vip.io/vipHost",
    ] {
        println!("  {key}: {}", annotation(&svc, key).unwrap_or("-"));
    }

    println!(
        "\nTCP from the client namespace to {ip}:{LISTEN_PORT} (each guest's listener answers with its node name):"
    );
    let reply = wait_for(Duration::from_secs(10), || {
        lb.tcp_from_client(ip, LISTEN_PORT).ok()
    })
    .context("no TCP answer through the LoadBalancer address")?;
    println!("  answered by: {reply}");

    println!("\nkubectl -n {} get loadbalancernodes:", lb::NAMESPACE);
    println!(
        "  {:<10} {:<6} {:<5} {:<32} HEARTBEAT",
        "NAME", "READY", "HELD", "ADDRESSES"
    );
    for i in 0..lb.rig.guest_count() {
        let node = lb.node_name(i);
        let v = lb.node_object(&node).unwrap_or_default();
        let st = &v["status"];
        println!(
            "  {node:<10} {:<6} {:<5} {:<32} {}",
            st["ready"].to_string(),
            st["held"].to_string(),
            st["addresses"].as_str().unwrap_or(""),
            st["heartbeat"].as_str().unwrap_or("")
        );
    }
    println!("  links carrying {ip} (read with `ip addr` in each guest):");
    for (node, link) in lb.carriers(ip) {
        println!(
            "    {node}: {} {} {}",
            link.name,
            link.mac,
            link.addrs.join(" ")
        );
    }

    if hold {
        println!(
            "\nholding; rig dir {} ; admin kubeconfig {} ; Ctrl-C to stop",
            lb.rig.dir().display(),
            api.admin_kubeconfig().display()
        );
        lb.block_on(async { tokio::signal::ctrl_c().await })?;
    }

    println!("\nkubectl delete service web:");
    let mark = lb.dnsmasq_log_len();
    lb.delete_service("web")?;
    wait_for(Duration::from_secs(30), || {
        lb.service("web").is_none().then_some(())
    })
    .context("Service web was not released")?;
    for line in lb
        .dnsmasq_log_from(mark)
        .lines()
        .filter(|l| l.contains("DHCPRELEASE"))
    {
        println!("  dnsmasq: {}", line.trim());
    }
    let left: usize = (0..lb.rig.guest_count())
        .map(|i| lb.hlb_links(i).len())
        .sum();
    println!("  links left on the guests: {left}");

    drop(lb);
    println!(
        "\nrig torn down: namespaces, dnsmasq, etcd, kube-apiserver, agents, controllers gone."
    );
    Ok(())
}
