//! The controller at scale (issue #11): 1,000 DHCP Services over 50 nodes'
//! objects, on the rig's real kube-apiserver, with one real controller
//! replica. The 50 node agents are simulated by this bench (a loop that,
//! every second, writes each node's status: a fresh heartbeat and every
//! assigned lease BOUND), since 50 real agents need 50 VMs' worth of
//! namespaces and DHCP; the controller cannot tell the difference, it only
//! reads the objects.
//!
//! Measures: time until all 1,000 have an address in status; the
//! controller's resident memory (VmRSS) then and after a minute of steady
//! state; its API writes per second in that minute (the agents' heartbeats,
//! 50 per second here, come on top); and, after a controller restart, the
//! time until the new one has reconciled everything and how many writes
//! that took.
//!
//! ```text
//! sudo cargo bench --bench scale [-- --services 1000 --nodes 50 --steady 60]
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod common;

use anyhow::{Context, Result, bail, ensure};
use common::rss_kib;
use harvester_node_agent::contract::node_object::{self, LeaseReport, LoadBalancerNode, Status};
use harvester_node_agent::contract::{harvester, kube_vip};
use hna_testkit::lb::{self, LbRig};
use hna_testkit::rig::apiserver::free_port;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, ListParams, Patch, PatchParams};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");

fn main() -> Result<()> {
    let (mut services, mut nodes, mut steady) = (1000usize, 50usize, 60u64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        // cargo bench passes --bench; nothing else is expected.
        let mut next = || args.next().with_context(|| format!("{a} N"));
        match a.as_str() {
            "--services" => services = next()?.parse()?,
            "--nodes" => nodes = next()?.parse()?,
            "--steady" => steady = next()?.parse()?,
            _ => {}
        }
    }
    ensure!(
        services >= 1 && nodes >= 1,
        "--services and --nodes at least 1"
    );
    // etcd fsyncs every write; on this machine's disk 1,000 Services and
    // 50 heartbeats a second push iowait to 50% and the bench measures the
    // disk, not the controller. So the rig (etcd's data with it) lives on
    // tmpfs unless the caller chose a TMPDIR.
    if std::env::var_os("TMPDIR").is_none() && Path::new("/dev/shm").is_dir() {
        // SAFETY: no other thread exists yet.
        unsafe { std::env::set_var("TMPDIR", "/dev/shm") };
    }
    let port = free_port()?;
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");
    let mut lb = LbRig::start(lb::Options {
        guests: 0,
        controllers: 1,
        controller_args: vec!["--metrics-listen".into(), format!("127.0.0.1:{port}")],
        ..lb::Options::new(BIN, &manifests)
    })?;
    for n in 0..nodes {
        lb.register_node(&format!("scale-node-{n:02}"))?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let agents = {
        let kubeconfig = lb
            .rig
            .apiserver()
            .context("API server")?
            .admin_kubeconfig()
            .to_path_buf();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let r = simulated_agents(&kubeconfig, stop.clone());
            if let Err(e) = &r {
                // Say so at once: the controller would wait for ever.
                eprintln!("simulated agents failed: {e:#}");
                std::process::exit(1);
            }
            r
        })
    };

    let t0 = Instant::now();
    for i in 0..services {
        lb.create_service(
            &format!("scale-{i:04}"),
            &[(harvester::IPAM, "dhcp")],
            &[80],
        )?;
    }
    let created = t0.elapsed();
    // What the API says, not what the controller reports of itself.
    let served = wait_services(&lb, services, Duration::from_secs(600), |s| {
        lb::ingress_ip(s).is_some()
    })?;
    let converged = t0.elapsed();
    eprintln!(
        "{services} Services created in {created:?}, all with an address in status after {converged:?}"
    );
    // kube-vip's record is each Service's last write; a pass's writes are
    // counted when the pass ends, so the steady state starts once every
    // record is there and the count has stood still.
    wait_services(&lb, services, Duration::from_secs(600), |s| {
        s.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(kube_vip::VIP_HOST))
    })?;
    wait_quiet(port, Duration::from_secs(120))?;
    let rss_converged = rss_kib(lb.controller_pid(0).context("controller pid")?)?;
    let versions = service_versions(&lb)?;

    let pid = lb.controller_pid(0).context("controller pid")?;
    let (before, cpu_before, steady_from) = (metrics(port)?, cpu_ticks(pid)?, Instant::now());
    std::thread::sleep(Duration::from_secs(steady));
    let (after, cpu_after) = (metrics(port)?, cpu_ticks(pid)?);
    let cpu_share = (cpu_after - cpu_before) as f64
        / clock_ticks_per_second()
        / steady_from.elapsed().as_secs_f64();
    let rss_steady = rss_kib(lb.controller_pid(0).context("controller pid")?)?;
    let writes = writes_total(&after) - writes_total(&before);
    let reconciles = counter(&after, "hna_controller_reconciles_total")
        - counter(&before, "hna_controller_reconciles_total");
    let watch_errors = counter(&after, "hna_controller_watch_errors_total")
        - counter(&before, "hna_controller_watch_errors_total");

    let after_steady = service_versions(&lb)?;
    let changed_steady = changed_services(&versions, &after_steady);

    lb.kill_controller(0);
    let restarted = Instant::now();
    lb.start_controller(0)?;
    // Nothing on the API changes when the new controller finds everything
    // in order: its own count of served Services, after its first pass
    // over complete caches, is the only witness of when it is done.
    wait_served(port, services, Duration::from_secs(600))?;
    let took = restarted.elapsed();
    wait_quiet(port, Duration::from_secs(120))?;
    let restart_writes = metrics(port)?
        .lines()
        .filter(|l| l.starts_with("hna_controller_writes_total{"))
        .map(str::to_string)
        .collect::<Vec<_>>();
    let changed_restart = changed_services(&after_steady, &service_versions(&lb)?);
    let rss_restart = rss_kib(lb.controller_pid(0).context("controller pid")?)?;

    stop.store(true, Ordering::SeqCst);
    let agent_writes = agents.join().expect("agents")?;

    println!(
        "\n{services} DHCP Services, {nodes} nodes (simulated agents, heartbeat 1 s), one controller"
    );
    println!(
        "all {served} with an address in status, after creation began {:.1} s",
        converged.as_secs_f64()
    );
    println!("controller VmRSS when converged              {rss_converged:>10} KiB");
    println!("controller VmRSS after {steady} s steady           {rss_steady:>10} KiB");
    println!(
        "controller writes per second, steady         {:>10.2} (reconcile passes: {:.2}/s)",
        writes as f64 / steady as f64,
        reconciles as f64 / steady as f64
    );
    println!(
        "controller CPU, steady (share of one core)   {:>9.1} %",
        cpu_share * 100.0
    );
    println!("controller watch errors, steady              {watch_errors:>10}");
    println!("Services changed on the API, steady          {changed_steady:>10}");
    println!(
        "agents' status writes per second (simulated) {:>10.1}",
        agent_writes.per_second
    );
    println!(
        "restart: start → everything reconciled       {:>10.1} s",
        took.as_secs_f64()
    );
    println!(
        "restart: writes the new controller made      {:>10} ({})",
        restart_writes
            .iter()
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>(),
        if restart_writes.is_empty() {
            "none".to_string()
        } else {
            restart_writes.join(", ")
        }
    );
    println!("restart: Services changed on the API         {changed_restart:>10}");
    println!("controller VmRSS after the restart           {rss_restart:>10} KiB");
    Ok(())
}

struct AgentWrites {
    per_second: f64,
}

/// Every second, every node's status: a new heartbeat, ready, and each
/// assignment's lease BOUND at its requested address (or one made up from
/// the Service's place in the list).
fn simulated_agents(kubeconfig: &Path, stop: Arc<AtomicBool>) -> Result<AgentWrites> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        // A client of this runtime's own: the rig's admin client runs its
        // connection on the rig's runtime, which nothing drives meanwhile.
        let client = hna_testkit::rig::kube_client(kubeconfig).await?;
        let api: Api<LoadBalancerNode> =
            Api::namespaced_with(client, lb::NAMESPACE, &node_object::api_resource());
        let mut addresses: BTreeMap<String, String> = BTreeMap::new();
        let (start, mut writes) = (Instant::now(), 0u64);
        let mut beat = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let round = Instant::now();
            beat += 1;
            for o in api.list(&ListParams::default()).await?.items {
                let Some(name) = o.metadata.name.clone() else {
                    continue;
                };
                let leases: Vec<LeaseReport> = o
                    .spec
                    .assignments
                    .iter()
                    .filter(|a| !a.release)
                    .map(|a| {
                        let n = addresses.len();
                        let address = a.requested_ip.clone().unwrap_or_else(|| {
                            addresses
                                .entry(a.uid.clone())
                                .or_insert_with(|| {
                                    format!(
                                        "10.{}.{}.{}",
                                        100 + n / 65536,
                                        (n / 256) % 256,
                                        n % 256
                                    )
                                })
                                .clone()
                        });
                        LeaseReport {
                            service: a.service.clone(),
                            interface: a.interface.clone(),
                            state: "BOUND".into(),
                            address: Some(address),
                            mac: a.mac.clone(),
                            ..LeaseReport::default()
                        }
                    })
                    .collect();
                let status = Status {
                    // RFC 3339 (the CRD says date-time), a millisecond
                    // later each round so it always changes.
                    heartbeat: Some(
                        humantime::format_rfc3339_millis(
                            std::time::SystemTime::UNIX_EPOCH
                                + Duration::from_secs(1_700_000_000)
                                + Duration::from_millis(beat),
                        )
                        .to_string(),
                    ),
                    heartbeat_period_ms: None,
                    restart_grace_ms: None,
                    ready: true,
                    reason: "Ready".into(),
                    macvlan_ready: true,
                    default_uplink: Some("eth0".into()),
                    nic_macs: Vec::new(),
                    gateway_mac: None,
                    gateway_address: None,
                    held: leases.len() as u32,
                    addresses: String::new(),
                    lan: None,
                    leases,
                    agent_version: "simulated".into(),
                };
                let patch = serde_json::json!({ "status": status });
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                writes += 1;
            }
            if let Some(rest) = Duration::from_secs(1).checked_sub(round.elapsed()) {
                tokio::time::sleep(rest).await;
            }
        }
        Ok(AgentWrites {
            per_second: writes as f64 / start.elapsed().as_secs_f64(),
        })
    })
}

/// Waits until `n` Services are `done`.
fn wait_services(
    lb: &LbRig,
    n: usize,
    within: Duration,
    done: impl Fn(&Service) -> bool,
) -> Result<usize> {
    let deadline = Instant::now() + within;
    loop {
        let list = lb.block_on(lb.services().list(&ListParams::default()))?;
        let count = list.items.iter().filter(|s| done(s)).count();
        if count >= n {
            return Ok(count);
        }
        if Instant::now() > deadline {
            bail!("only {count} of {n} Services are done after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Waits until the controller has made no write for 2 s.
fn wait_quiet(port: u16, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    let (mut last, mut since) = (u64::MAX, Instant::now());
    loop {
        let now = writes_total(&metrics(port)?);
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= Duration::from_secs(2) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the controller still writes after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn service_versions(lb: &LbRig) -> Result<BTreeMap<String, String>> {
    Ok(lb
        .block_on(lb.services().list(&ListParams::default()))?
        .items
        .into_iter()
        .filter_map(|s| Some((s.metadata.name?, s.metadata.resource_version?)))
        .collect())
}

fn changed_services(before: &BTreeMap<String, String>, after: &BTreeMap<String, String>) -> usize {
    before
        .iter()
        .filter(|(name, rv)| after.get(*name) != Some(rv))
        .count()
}

/// Waits until the controller's metrics say `n` Services are served.
fn wait_served(port: u16, n: usize, within: Duration) -> Result<usize> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(m) = metrics(port) {
            let served = counter(&m, "hna_controller_services{state=\"served\"}") as usize;
            if served >= n {
                return Ok(served);
            }
        }
        if Instant::now() > deadline {
            bail!("not all {n} Services served within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn metrics(port: u16) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// The value of the sample whose name and labels are exactly `series`.
fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

fn writes_total(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("hna_controller_writes_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// User plus system time of `pid`, in clock ticks (`/proc/PID/stat`).
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name, in parentheses, may hold spaces: count after it.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("/proc/PID/stat")?
        .1
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15; the first after ')' is 3.
    let field = |n: usize| -> Result<u64> { Ok(fields.get(n - 3).context("stat field")?.parse()?) };
    Ok(field(14)? + field(15)?)
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}
