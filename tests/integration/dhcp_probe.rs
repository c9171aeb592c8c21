//! `harvester-node-agent dhcp-probe` against dnsmasq on the rig, as an
//! operator runs it: a lease with every figure reported and released, no
//! server, Ctrl-C and SIGTERM mid-way, a missing uplink. Never an interface
//! or a lease left behind.

use std::net::Ipv4Addr;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hna_testkit::rig::process::run;
use hna_testkit::rig::{self, Rig, RigOptions};

use crate::BIN;
use crate::harness::tests;

tests! {
    lease_reported_released_and_nothing_left_behind: Root, Iproute2, Dnsmasq;
    no_server_interrupts_and_missing_uplink_fail_clearly: Root, Iproute2, Dnsmasq;
}

fn probe(rig: &Rig, ns: &str, args: &[&str]) -> Result<Output> {
    Ok(rig
        .netns_cmd(ns, BIN)
        .arg("dhcp-probe")
        .args(args)
        .output()?)
}

fn json(out: &Output) -> Result<serde_json::Value> {
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "not JSON: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// No `hna-probe-*` link in `ns`.
fn no_probe_links(ns: &str) -> Result<()> {
    let links = run(Command::new("ip").args(["-n", ns, "-br", "link"]))?;
    ensure!(
        !links.contains("hna-probe-"),
        "probe link left behind:\n{links}"
    );
    Ok(())
}

fn lease_reported_released_and_nothing_left_behind() -> Result<()> {
    let rig = Rig::start(RigOptions {
        guests: 1,
        lease_time: Some("2m".into()),
        dnsmasq_args: vec![
            "--dhcp-option=option:T1,50".into(),
            "--dhcp-option=option:T2,90".into(),
        ],
        ..Default::default()
    })?;
    let g = rig.guest_ns(0).to_string();
    let out = probe(
        &rig,
        &g,
        &[
            "--parent",
            "eth0",
            "--mac",
            "00:00:6c:70:00:01",
            "--hostname",
            "probe-host",
            "--output",
            "json",
        ],
    )?;
    let v = json(&out)?;
    ensure!(out.status.code() == Some(0), "exit {:?}: {v}", out.status);
    ensure!(v["ok"] == true && v["reason"] == "Bound", "{v}");
    ensure!(
        v["parent"] == "eth0" && v["mac"] == "00:00:6c:70:00:01",
        "{v}"
    );
    ensure!(v["server"] == rig::LAN_ADDR, "{v}");
    let addr: Ipv4Addr = v["address"].as_str().context("address")?.parse()?;
    ensure!(
        (Ipv4Addr::new(10, 77, 0, 100)..=Ipv4Addr::new(10, 77, 0, 199)).contains(&addr),
        "{addr}"
    );
    ensure!(v["lease_secs"] == 120.0, "{v}");
    ensure!(v["t1_secs"] == 50.0 && v["t2_secs"] == 90.0, "{v}");
    ensure!(v["routers"] == serde_json::json!([rig::LAN_ADDR]), "{v}");
    ensure!(v["released"] == true, "{v}");
    for step in [
        "offer_ms",
        "ack_ms",
        "arp_probe_ms",
        "bound_ms",
        "cleanup_ms",
    ] {
        ensure!(v["timings"][step].as_f64().is_some(), "{step}: {v}");
    }
    ensure!(v["counters"]["malformed"] == 0, "{v}");
    no_probe_links(&g)?;
    // The release reached the server: dnsmasq dropped the lease, and its
    // log saw the hostname (option 12).
    let deadline = Instant::now() + Duration::from_secs(3);
    while rig.dnsmasq_leases()?.contains(&addr.to_string()) {
        ensure!(
            Instant::now() < deadline,
            "lease not released:\n{}",
            rig.dnsmasq_leases()?
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = std::fs::read_to_string(rig.dnsmasq_log())?;
    ensure!(
        log.contains("DHCPRELEASE") && log.contains("probe-host"),
        "{log}"
    );

    // --release=false keeps the lease on the server (and still removes the
    // macvlan); the human report names every figure.
    let out = probe(
        &rig,
        &g,
        &["--parent", "eth0", "--no-arp-probe", "--release=false"],
    )?;
    let human = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "{human}");
    for word in [
        "dhcp-probe on eth0 via hna-probe-",
        "server:",
        "lease:",
        "router:",
        "timings:",
        "released:  no",
    ] {
        ensure!(human.contains(word), "{word} missing in:\n{human}");
    }
    ensure!(
        human.contains("ARP probe -,"),
        "--no-arp-probe still probed:\n{human}"
    );
    no_probe_links(&g)?;
    ensure!(
        rig.dnsmasq_leases()?.lines().count() == 1,
        "{}",
        rig.dnsmasq_leases()?
    );
    Ok(())
}

fn no_server_interrupts_and_missing_uplink_fail_clearly() -> Result<()> {
    let mut rig = Rig::start(RigOptions {
        guests: 1,
        ..Default::default()
    })?;
    let g = rig.guest_ns(0).to_string();
    rig.stop_dhcp();

    let t0 = Instant::now();
    let out = probe(
        &rig,
        &g,
        &["--parent", "eth0", "--timeout", "2s", "--output", "json"],
    )?;
    let v = json(&out)?;
    ensure!(out.status.code() == Some(1), "{v}");
    ensure!(v["reason"] == "NoReply", "{v}");
    ensure!(
        v["message"]
            .as_str()
            .unwrap_or("")
            .contains("is DHCP enabled"),
        "{v}"
    );
    ensure!(
        t0.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t0.elapsed()
    );
    no_probe_links(&g)?;

    for (sig, word) in [
        (nix::sys::signal::Signal::SIGINT, "SIGINT"),
        (nix::sys::signal::Signal::SIGTERM, "SIGTERM"),
    ] {
        let child = rig
            .netns_cmd(&g, BIN)
            .args([
                "dhcp-probe",
                "--parent",
                "eth0",
                "--timeout",
                "60s",
                "--output",
                "json",
            ])
            .stdout(Stdio::piped())
            .spawn()?;
        // Wait for the macvlan: the interruption lands mid-exchange.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !run(Command::new("ip").args(["-n", &g, "-br", "link"]))?.contains("hna-probe-") {
            ensure!(Instant::now() < deadline, "probe link never appeared");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig)?;
        let out = child.wait_with_output()?;
        let v = json(&out)?;
        ensure!(out.status.code() == Some(1), "{word}: {v}");
        ensure!(
            v["reason"] == "Interrupted" && v["message"].as_str().unwrap_or("").contains(word),
            "{v}"
        );
        no_probe_links(&g)?;
    }

    let out = probe(&rig, &g, &["--parent", "nosuch0", "--output", "json"])?;
    let v = json(&out)?;
    ensure!(
        out.status.code() == Some(1) && v["reason"] == "MacvlanNotReady",
        "{v}"
    );
    ensure!(
        v["message"].as_str().unwrap_or("").contains("nosuch0"),
        "{v}"
    );
    no_probe_links(&g)?;
    Ok(())
}
