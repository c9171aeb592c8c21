//! Self-tests of the test rig (`hna_testkit::rig`): real namespaces, real
//! dnsmasq, real kube-apiserver.

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hna_testkit::rig::process::{pid_alive, run};
use hna_testkit::rig::{self, Rig, RigOptions, find_program};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, PostParams};

use crate::harness::tests;

tests! {
    dhcp_lease_through_macvlan: Root, Iproute2, Dnsmasq, Busybox;
    apiserver_service_roundtrip: Root, Iproute2, ApiServer;
    guest_namespace_reaches_apiserver: Root, Iproute2, ApiServer, Curl;
    teardown_leaves_nothing: Root, Iproute2, Dnsmasq, ApiServer;
    teardown_after_panic: Root, Iproute2, Dnsmasq;
    lan_host_reaches_a_guest: Root, Iproute2;
    an_unserved_release_stops_the_go_builds_and_caches_nothing: ApiServer;
}

/// The path of a tool the test needs (declared as its prerequisite).
fn tool(name: &str) -> Result<std::path::PathBuf> {
    find_program(name).with_context(|| format!("`{name}` not found"))
}

fn dhcp_lease_through_macvlan() -> Result<()> {
    let busybox = tool("busybox")?;
    let rig = Rig::start(RigOptions {
        guests: 1,
        ..Default::default()
    })?;
    let g = rig.guest_ns(0);
    run(Command::new("ip").args([
        "-n", g, "link", "add", "mv0", "link", "eth0", "type", "macvlan", "mode", "bridge",
    ]))?;
    run(Command::new("ip").args(["-n", g, "link", "set", "mv0", "up"]))?;
    let link: serde_json::Value = serde_json::from_str(&run(
        Command::new("ip").args(["-j", "-n", g, "link", "show", "mv0"])
    )?)?;
    let mac = link[0]["address"]
        .as_str()
        .context("mv0 has no MAC")?
        .to_lowercase();

    let env_file = rig.dir().join("udhcpc.env");
    let script = rig.dir().join("udhcpc.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n[ \"$1\" = bound ] && env > {}\nexit 0\n",
            env_file.display()
        ),
    )?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;

    let started = Instant::now();
    let out = rig
        .netns_cmd(g, &busybox)
        .args([
            "udhcpc", "-i", "mv0", "-f", "-q", "-n", "-t", "5", "-T", "1", "-s",
        ])
        .arg(&script)
        .output()?;
    let took = started.elapsed();
    ensure!(
        out.status.success(),
        "udhcpc failed ({}): {}\ndnsmasq log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        rig::process::tail(&rig.dnsmasq_log(), 30)
    );
    let env = std::fs::read_to_string(&env_file).context("udhcpc script did not run")?;
    let ip: Ipv4Addr = env
        .lines()
        .find_map(|l| l.strip_prefix("ip="))
        .context("no ip= in udhcpc env")?
        .parse()?;
    eprintln!("udhcpc got {ip} for {mac} in {took:?}");
    ensure!(
        (Ipv4Addr::new(10, 77, 0, 100)..=Ipv4Addr::new(10, 77, 0, 199)).contains(&ip),
        "{ip} outside the DHCP range"
    );
    ensure!(
        env.contains("lease=3600"),
        "expected a 1h lease, env:\n{env}"
    );
    // dnsmasq sends renewal (T1, 58) and rebinding (T2, 59) times.
    ensure!(
        env.contains("opt58=") && env.contains("opt59="),
        "no options 58/59, env:\n{env}"
    );

    // dnsmasq writes the lease file right after the ACK; allow a moment.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let leases = rig.dnsmasq_leases()?;
        if leases
            .lines()
            .any(|l| l.contains(&mac) && l.contains(&ip.to_string()))
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "lease for {mac}/{ip} not in lease file:\n{leases}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn apiserver_service_roundtrip() -> Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(apiserver_service_roundtrip_async())
}

async fn apiserver_service_roundtrip_async() -> Result<()> {
    let rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })?;
    let api = rig.apiserver().expect("started with apiserver");
    eprintln!(
        "kube-apiserver {} ready after {:?}",
        api.version(),
        api.ready_after()
    );

    let admin = rig::kube_client(api.admin_kubeconfig()).await?;
    let services: Api<Service> = Api::namespaced(admin, "default");
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": "rig-selftest" },
        "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] }
    }))?;
    services.create(&PostParams::default(), &svc).await?;
    let back = services.get("rig-selftest").await?;
    let spec = back.spec.context("service without spec")?;
    ensure!(spec.type_.as_deref() == Some("LoadBalancer"));
    ensure!(
        spec.cluster_ip.is_some_and(|ip| ip.starts_with("10.96.")),
        "clusterIP not from 10.96.0.0/16"
    );

    // Authorization is on: a node may not create Services.
    let node = rig::kube_client(api.node_kubeconfig(rig.node_name(0))).await?;
    let as_node: Api<Service> = Api::namespaced(node, "default");
    let mut svc2 = svc.clone();
    svc2.metadata.name = Some("rig-selftest-node".into());
    match as_node.create(&PostParams::default(), &svc2).await {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => anyhow::bail!("node user creating a Service: expected 403, got {other:?}"),
    }
    // ... and neither may the controller before RBAC grants it anything.
    let ctrl = rig::kube_client(api.controller_kubeconfig()).await?;
    match Api::<Service>::namespaced(ctrl, "default")
        .get("rig-selftest")
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => anyhow::bail!("controller reading a Service: expected 403, got {other:?}"),
    }
    Ok(())
}

fn guest_namespace_reaches_apiserver() -> Result<()> {
    let curl = tool("curl")?;
    let rig = Rig::start(RigOptions {
        guests: 2,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })?;
    let api = rig.apiserver().expect("started with apiserver");
    for g in rig.guest_namespaces() {
        // No -k: the CA and the 127.0.0.1 SAN must verify from in there too.
        let body = run(rig
            .netns_cmd(g, &curl)
            .args(["-sS", "--fail", "--max-time", "10", "--cacert"])
            .arg(api.ca_path())
            .arg("-H")
            .arg(format!("Authorization: Bearer {}", api.admin_token()))
            .arg(format!("{}/version", api.url())))?;
        let v: serde_json::Value = serde_json::from_str(&body)?;
        ensure!(
            v["gitVersion"] == api.version(),
            "{g}: unexpected /version {body}"
        );
    }
    // The guest's own loopback is really separate: nothing on another port.
    let other = rig::apiserver::free_port()?;
    let out = rig
        .netns_cmd(rig.guest_ns(0), &curl)
        .args([
            "-sS",
            "--max-time",
            "3",
            &format!("http://127.0.0.1:{other}/"),
        ])
        .output()?;
    ensure!(
        !out.status.success(),
        "unexpected listener on {other} in the guest"
    );
    Ok(())
}

fn teardown_leaves_nothing() -> Result<()> {
    let rig = Rig::start(RigOptions {
        guests: 2,
        dhcp: true,
        apiserver: true,
        ..Default::default()
    })?;
    let mut namespaces = vec![rig.lan_ns().to_string()];
    namespaces.extend(rig.guest_namespaces().iter().cloned());
    let pids = rig.pids();
    ensure!(
        pids.len() == 3,
        "dnsmasq, etcd, kube-apiserver: pids {pids:?}"
    );
    let dir = rig.dir().to_path_buf();
    // A process a test forgot in a guest namespace must not survive either.
    let mut straggler = rig
        .netns_cmd(rig.guest_ns(1), "sleep")
        .arg("1000")
        .spawn()?;
    // `ip netns exec` enters the namespace, then execs `sleep` in the same
    // process: wait until the namespace lists it.
    let deadline = Instant::now() + Duration::from_secs(5);
    let straggler_pid = straggler.id().to_string();
    while !run(Command::new("ip").args(["netns", "pids", rig.guest_ns(1)]))?
        .split_whitespace()
        .any(|p| p == straggler_pid)
    {
        ensure!(
            Instant::now() < deadline,
            "the straggler never entered {}",
            rig.guest_ns(1)
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    drop(rig);

    let listed = run(Command::new("ip").args(["netns", "list"]))?;
    for ns in &namespaces {
        ensure!(
            !listed
                .lines()
                .any(|l| l.split_whitespace().next() == Some(ns)),
            "{ns} still listed"
        );
        ensure!(
            !std::path::Path::new("/run/netns").join(ns).exists(),
            "{ns} still in /run/netns"
        );
    }
    for pid in pids {
        ensure!(!pid_alive(pid), "rig process {pid} still alive");
    }
    let status = straggler.try_wait()?.context("straggler still running")?;
    ensure!(!status.success(), "straggler exited normally?");
    ensure!(
        !dir.exists() || std::env::var("HNA_RIG_KEEP").as_deref() == Ok("1"),
        "{} not removed",
        dir.display()
    );
    Ok(())
}

fn teardown_after_panic() -> Result<()> {
    let names = std::sync::Mutex::new(None);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<()> {
        let rig = Rig::start(RigOptions::default())?;
        let mut ns = vec![rig.lan_ns().to_string()];
        ns.extend(rig.guest_namespaces().iter().cloned());
        *names.lock().unwrap() = Some((ns, rig.pids(), rig.dir().to_path_buf()));
        panic!("deliberate panic while holding the rig (expected by this test)");
    }));
    if let Ok(started) = outcome {
        started.context("the rig did not start")?;
        anyhow::bail!("the closure returned without its deliberate panic");
    }
    let (namespaces, pids, dir) = names
        .into_inner()
        .unwrap()
        .context("panicked before the rig ran")?;
    for ns in &namespaces {
        ensure!(
            !std::path::Path::new("/run/netns").join(ns).exists(),
            "{ns} survived the panic"
        );
    }
    for pid in pids {
        ensure!(!pid_alive(pid), "rig process {pid} survived the panic");
    }
    ensure!(
        !dir.exists() || std::env::var("HNA_RIG_KEEP").as_deref() == Ok("1"),
        "{} not removed",
        dir.display()
    );
    Ok(())
}

/// A LAN host (`Rig::add_lan_host`) is a separate machine on the bridge: a
/// TCP connection from it reaches a guest and arrives from its address; its
/// namespace goes with the rig.
fn lan_host_reaches_a_guest() -> Result<()> {
    let mut rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        ..Default::default()
    })?;
    let a = rig.add_lan_host("client")?;
    let b = rig.add_lan_host("prober")?;
    ensure!(
        a.addr == rig::LAN_HOST_FIRST && b.addr == Ipv4Addr::new(10, 77, 0, 201),
        "addresses {} and {}",
        a.addr,
        b.addr
    );
    ensure!(rig.lan_hosts() == [a.clone(), b.clone()]);
    let guest = rig.guest_ns(0).to_string();
    run(Command::new("ip").args(["-n", &guest, "addr", "add", "10.77.0.10/24", "dev", "eth0"]))?;
    // A socket stays in the namespace it was made in.
    let listener = rig::in_netns(&guest, async || {
        std::net::TcpListener::bind((Ipv4Addr::new(10, 77, 0, 10), 0))
    })??;
    let port = listener.local_addr()?.port();
    let accepted = std::thread::spawn(move || -> std::io::Result<Vec<Ipv4Addr>> {
        (0..2)
            .map(|_| match listener.accept()?.1.ip() {
                std::net::IpAddr::V4(ip) => Ok(ip),
                other => Err(std::io::Error::other(format!("peer {other}"))),
            })
            .collect()
    });
    for host in [&a, &b] {
        // One after the other, so the guest accepts them in this order.
        rig::in_netns(&host.ns, async || {
            tokio::time::timeout(
                Duration::from_secs(5),
                tokio::net::TcpStream::connect((Ipv4Addr::new(10, 77, 0, 10), port)),
            )
            .await
        })?
        .with_context(|| format!("{} connecting", host.name))??;
    }
    let peers = accepted.join().expect("accept thread")?;
    ensure!(peers == [a.addr, b.addr], "connections from {peers:?}");
    drop(rig);
    let listed = run(Command::new("ip").args(["netns", "list"]))?;
    for ns in [&a.ns, &b.ns] {
        ensure!(
            !listed
                .lines()
                .any(|l| l.split_whitespace().next() == Some(ns)),
            "{ns} still listed"
        );
    }
    Ok(())
}

/// `tests/rig/kubernetes.sh` with a Kubernetes release and an etcd version
/// the Go module proxy does not serve: it stops (before building anything)
/// naming the module, the version and the command that failed, and leaves
/// no folder behind in the cache. Asks the proxy, nothing is built.
fn an_unserved_release_stops_the_go_builds_and_caches_nothing() -> Result<()> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rig/kubernetes.sh");
    for (var, module, version) in [
        ("HNA_KUBE_NEWEST", "k8s.io/kubernetes", "v1.99.0"),
        ("HNA_ETCD_VERSION", "go.etcd.io/etcd/server/v3", "v3.99.0"),
    ] {
        let cache = tempfile::tempdir()?;
        let out = Command::new("bash")
            .arg(&script)
            .arg("newest")
            .env("HNA_CACHE_DIR", cache.path())
            .env(var, version)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "{var}={version} succeeded: {err}");
        for said in [
            format!("module {module}, version {version}"),
            format!("go list -m -json {module}@{version}"),
        ] {
            ensure!(
                err.contains(&said),
                "{var}={version}: {said:?} not in:\n{err}"
            );
        }
        for built in ["kubernetes", "etcd"] {
            ensure!(
                !cache.path().join(built).exists(),
                "{var}={version}: {built}/ was created"
            );
        }
        let scratch: Vec<_> = std::fs::read_dir(cache.path().join("build"))?
            .flatten()
            .map(|e| e.file_name())
            .collect();
        ensure!(scratch.is_empty(), "scratch folders left: {scratch:?}");
    }
    Ok(())
}
