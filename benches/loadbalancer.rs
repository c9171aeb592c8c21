//! Service created → address in `status.loadBalancer.ingress` (issue #9),
//! over the whole product on the rig: a real kube-apiserver, two controller
//! replicas, agents in three guest namespaces with node credentials,
//! dnsmasq. Median and p90 over N Services (default 20), created one after
//! another, with and without the agents' ARP check (RFC 5227) of the
//! offered address; beside it, in the same run and the same guest, the
//! engine's own single-lease time (`dhcp-probe`: start → BOUND, macvlan
//! creation included), so the difference is what the control plane adds.
//!
//! ```text
//! sudo cargo bench --bench loadbalancer [-- --services 20]
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hna_testkit::lb::{self, LbRig, wait_for};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");

fn main() -> Result<()> {
    let mut services = 20usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        // cargo bench passes --bench; nothing else is expected.
        if a == "--services" {
            services = args.next().context("--services N")?.parse()?;
        }
    }
    ensure!(services >= 2, "--services must be at least 2");
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");

    let mut rows = Vec::new();
    for (arp, agent_config) in [(true, ""), (false, "lb_arp_probe = false")] {
        let lb = LbRig::start(lb::Options {
            agent_config: agent_config.into(),
            ..lb::Options::new(BIN, &manifests)
        })?;
        wait_nodes_ready(&lb)?;
        // One Service first, so connections and caches are warm.
        measure_one(&lb, "warm-up")?;
        let mut control = Vec::new();
        for i in 0..services {
            control.push(measure_one(&lb, &format!("bench-{i}"))?);
        }
        let mut engine = Vec::new();
        for _ in 0..services {
            engine.push(probe_once(&lb, arp)?);
        }
        let label = if arp { "ARP check on" } else { "ARP check off" };
        rows.push((format!("Service → status, {label}"), control));
        rows.push((format!("engine alone (dhcp-probe), {label}"), engine));
    }

    println!("\n{services} Services created one after another; milliseconds");
    println!(
        "{:<42} {:>8} {:>8} {:>8} {:>8}",
        "", "median", "p90", "min", "max"
    );
    for (label, mut ms) in rows {
        ms.sort_by(f64::total_cmp);
        println!(
            "{label:<42} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
            quantile(&ms, 0.5),
            quantile(&ms, 0.9),
            ms[0],
            ms[ms.len() - 1]
        );
    }
    Ok(())
}

/// Nearest-rank quantile of sorted values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Every agent has reported itself ready in its object, so the first
/// Service does not wait for a node to come up.
fn wait_nodes_ready(lb: &LbRig) -> Result<()> {
    for i in 0..lb.rig.guest_count() {
        let node = lb.node_name(i);
        wait_for(Duration::from_secs(60), || {
            let v = lb.node_object(&node)?;
            (v["status"]["ready"] == true).then_some(())
        })
        .with_context(|| format!("node {node} never reported ready"))?;
    }
    Ok(())
}

/// Creates Service `name` and returns the milliseconds until its address
/// is in its status (polled every millisecond).
fn measure_one(lb: &LbRig, name: &str) -> Result<f64> {
    let t0 = Instant::now();
    lb.create_service(
        name,
        &[("cloudprovider.harvesterhci.io/ipam", "dhcp")],
        &[80],
    )?;
    loop {
        if lb.ingress_ip(name).is_some() {
            return Ok(t0.elapsed().as_secs_f64() * 1000.0);
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("{name} got no address within 60 s");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The engine's own time to BOUND for one lease in guest 0, as
/// `dhcp-probe` reports it (macvlan created, DISCOVER to ACK, ARP check).
fn probe_once(lb: &LbRig, arp: bool) -> Result<f64> {
    let mut cmd = lb.rig.netns_cmd(lb.rig.guest_ns(0), BIN);
    cmd.args(["dhcp-probe", "--parent", "eth0", "--output", "json"]);
    if !arp {
        cmd.arg("--no-arp-probe");
    }
    let out = cmd.output()?;
    ensure!(
        out.status.success(),
        "dhcp-probe: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    report["timings"]["bound_ms"]
        .as_f64()
        .context("dhcp-probe reported no bound_ms")
}
