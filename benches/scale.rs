//! The control plane at scale (issue #30, item 6): N nodes and S DHCP
//! Services on the rig's real kube-apiserver and etcd (on tmpfs), with the
//! real controller, two replicas.
//!
//! Each node is simulated in this process, but the way a node talks to the
//! API server is the agent's own: a client of its own with its own node
//! credentials (`system:node:<name>` in `system:nodes`, so API Priority and
//! Fairness, the Node authorizer and the controller's per-node RBAC apply),
//! the agent's three watches (its own `LoadBalancerNode` through the
//! agent's `follow`, its Node, the membership Secret), its status written
//! by the agent's own writer (`loadbalancer::status_writes` with `KubeStatus`:
//! written when it changes, else every `lb_heartbeat`, 10 s; a renewal's
//! new expiry rides along with the next one) and its Node conditions
//! (`node_conditions::reconcile`: read every 5 minutes, written when they differ). What is simulated
//! is the host: each assigned lease goes BOUND 50 ms after the node read
//! its assignment, and renews at half its lease time (`--lease-time`). Its
//! LAN report lists the nodes it witnesses on the controller's own ring as
//! heard. The failover at the end is one node dying: its simulation stops
//! and its witnesses report it down, as their membership would.
//!
//! Everything it reports comes from the API server's, etcd's and the
//! kernel's own counters (`/metrics`, `/proc`), and what the API says
//! (Services' status, nodes' objects) as an admin watch sees it; nothing
//! from the controller's report of itself.
//!
//! ```text
//! sudo cargo bench --bench scale [-- --nodes 500 --services 10000 --rest-minutes 12]
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

mod common;

use anyhow::{Context, Result, bail, ensure};
use common::rss_kib;
use futures::{StreamExt, TryStreamExt};
use hna_contract::harvester;
use hna_contract::membership::{self, LanReport, witnesses_of};
use hna_contract::node_object::{self, Assignment, LeaseReport, LoadBalancerNode, Status};
use hna_edges::cluster::credentials::WATCH_TIMEOUT_SECS;
use hna_edges::cluster::watch_one::{Update, watch_one};
use hna_node::loadbalancer::status_writes::StatusWrites;
use hna_node::loadbalancer::task::{KubeStatus, SpecRead, follow};
use hna_node::node_conditions;
use hna_testkit::lb::{self, LbRig};
use hna_testkit::promtext::{Sample, is_write, parse as parse_metrics, quantile, sum};
use k8s_openapi::api::core::v1::{Node, Secret, Service};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use tokio::sync::{mpsc, watch};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");
/// The agent's default `lb_heartbeat`.
const HEARTBEAT: Duration = Duration::from_secs(10);
/// A simulated DHCP exchange: from reading an assignment to BOUND.
const DHCP_EXCHANGE: Duration = Duration::from_millis(50);
/// The simulated LAN: every node's uplink and the gateway.
const LAN: &str = "10.64.0.0/16";
const GATEWAY: &str = "10.64.255.254";

struct Args {
    nodes: usize,
    services: usize,
    rest_minutes: u64,
    controllers: usize,
    lease_time: Duration,
    create_parallel: usize,
    baseline: usize,
}

impl Args {
    fn parse() -> Result<Args> {
        let mut a = Args {
            nodes: 500,
            services: 10_000,
            rest_minutes: 12,
            controllers: 2,
            lease_time: Duration::from_secs(600),
            create_parallel: 16,
            baseline: 1000,
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            // cargo bench passes --bench; nothing else is expected.
            let mut next = || args.next().with_context(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--nodes" => a.nodes = next()?.parse()?,
                "--services" => a.services = next()?.parse()?,
                "--rest-minutes" => a.rest_minutes = next()?.parse()?,
                "--controllers" => a.controllers = next()?.parse()?,
                "--lease-time" => a.lease_time = Duration::from_secs(next()?.parse()?),
                "--create-parallel" => a.create_parallel = next()?.parse()?,
                "--baseline" => a.baseline = next()?.parse()?,
                "--help" | "-h" => {
                    println!(
                        "sudo cargo bench --bench scale -- [--nodes 500] [--services 10000] \
                         [--rest-minutes 12] [--controllers 2] [--lease-time SECS (600)] \
                         [--create-parallel 16] [--baseline 1000]"
                    );
                    std::process::exit(0);
                }
                _ => {}
            }
        }
        ensure!(
            a.nodes >= 4,
            "--nodes: at least 4 (a node and its 3 witnesses)"
        );
        ensure!(a.services >= 1, "--services: at least 1");
        ensure!(a.controllers >= 1, "--controllers: at least 1");
        ensure!(
            a.lease_time >= Duration::from_secs(120),
            "--lease-time: at least 120 (dnsmasq's minimum)"
        );
        Ok(a)
    }
}

/// What the bench needs of the rig, outside the rig's own runtime.
struct Setup {
    admin: PathBuf,
    nodes: Vec<(String, PathBuf)>,
    etcd_url: String,
    version: String,
    controllers: Vec<u32>,
}

fn main() -> Result<()> {
    let args = Args::parse()?;
    // etcd fsyncs every write; on this machine's disk that measures the
    // disk, not the control plane. The rig (etcd's data with it) lives on
    // tmpfs unless the caller chose a TMPDIR.
    if std::env::var_os("TMPDIR").is_none() && Path::new("/dev/shm").is_dir() {
        // SAFETY: no other thread exists yet.
        unsafe { std::env::set_var("TMPDIR", "/dev/shm") };
    }
    let names: Vec<String> = (0..args.nodes).map(|i| format!("sim-{i:04}")).collect();
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");
    eprintln!(
        "starting the rig: kube-apiserver, etcd, {} controller replicas, credentials for {} nodes",
        args.controllers, args.nodes
    );
    let lb = LbRig::start(lb::Options {
        guests: 0,
        controllers: args.controllers,
        simulated_nodes: names.clone(),
        ..lb::Options::new(BIN, &manifests)
    })?;
    let api = lb.rig.apiserver().context("API server")?;
    let setup = Setup {
        admin: api.admin_kubeconfig().to_path_buf(),
        nodes: names
            .iter()
            .map(|n| (n.clone(), api.node_kubeconfig(n).to_path_buf()))
            .collect(),
        etcd_url: api.etcd_url().to_string(),
        version: api.version().to_string(),
        controllers: (0..args.controllers)
            .map(|i| lb.controller_pid(i).context("controller pid"))
            .collect::<Result<_>>()?,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = rt.block_on(run(&args, &setup))?;
    drop(rt);
    report.print(&args, &setup);
    Ok(())
}

struct Report {
    registered: Duration,
    created: Duration,
    converged: Duration,
    rest: Window,
    /// Counts from the first of our Services created until at rest.
    creation: Window,
    whole: Window,
    etcd: Vec<EtcdSample>,
    controllers: Vec<ControllerUse>,
    failover: FailoverResult,
    denied: String,
    /// Services per second the API server creates when nobody reacts.
    baseline: Option<f64>,
}

async fn run(args: &Args, setup: &Setup) -> Result<Report> {
    let admin = hna_testkit::rig::kube_client(&setup.admin).await?;
    let start_metrics = api_metrics(&admin).await?;
    let seen = Arc::new(Mutex::new(Seen::new(args.services)));
    let observer = tokio::spawn(observe(admin.clone(), seen.clone()));

    eprintln!("registering {} Nodes", args.nodes);
    let t = Instant::now();
    let nodes: Api<Node> = Api::all(admin.clone());
    futures::stream::iter(&setup.nodes)
        .map(|(name, _)| {
            let nodes = nodes.clone();
            async move {
                let node: Node = serde_json::from_value(serde_json::json!({
                    "apiVersion": "v1", "kind": "Node", "metadata": {"name": name}
                }))?;
                nodes
                    .create(&PostParams::default(), &node)
                    .await
                    .with_context(|| format!("creating Node {name}"))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;

    // Who witnesses whom: the controller's own ring.
    let all: Vec<&str> = setup.nodes.iter().map(|(n, _)| n.as_str()).collect();
    let witnesses: BTreeMap<&str, Vec<String>> = all
        .iter()
        .map(|n| (*n, witnesses_of(all.iter().copied(), n)))
        .collect();
    let mut watched: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (n, ws) in &witnesses {
        for w in ws {
            watched.entry(w.as_str()).or_default().push(n.to_string());
        }
    }
    let addresses = Arc::new(Addresses::default());
    let mut sims: BTreeMap<String, SimNode> = BTreeMap::new();
    for (i, (name, kubeconfig)) in setup.nodes.iter().enumerate() {
        let client = hna_testkit::rig::kube_client(kubeconfig).await?;
        let mut hears = watched.get(name.as_str()).cloned().unwrap_or_default();
        hears.sort();
        let lan = LanReport {
            address: format!("{}:{}", node_ip(i), membership::DEFAULT_PORT),
            network: LAN.into(),
            down: Vec::new(),
            hears,
            alive: (args.nodes - 1).min(2 * membership::PEERS_EACH_SIDE) as u32,
            unheard: false,
        };
        sims.insert(
            name.clone(),
            SimNode::start(
                name.clone(),
                i,
                client,
                lan,
                addresses.clone(),
                args.lease_time,
            ),
        );
    }
    wait(
        &seen,
        Duration::from_secs(600),
        "every node's first status",
        |s| s.with_status.len() >= args.nodes,
    )
    .await?;
    let registered = t.elapsed();
    eprintln!("{} nodes report, after {registered:?}", args.nodes);
    let denied = node_authorization_applies(&setup.nodes).await?;
    let baseline = if args.baseline > 0 {
        eprintln!(
            "the API server's own pace: {} ClusterIP Services nobody reacts to",
            args.baseline
        );
        let t = Instant::now();
        create_services(
            &admin,
            "baseline",
            args.baseline,
            args.create_parallel,
            false,
        )
        .await?;
        Some(args.baseline as f64 / t.elapsed().as_secs_f64())
    } else {
        None
    };

    eprintln!(
        "creating {} Services, {} at a time",
        args.services, args.create_parallel
    );
    let creation_from = api_metrics(&admin).await?;
    let t0 = Instant::now();
    create_services(&admin, "default", args.services, args.create_parallel, true).await?;
    let created = t0.elapsed();
    eprintln!("created in {created:?}; waiting until each has an address");
    wait(
        &seen,
        Duration::from_secs(1200),
        "every Service served",
        |s| s.served_all_at.is_some(),
    )
    .await?;
    let converged = seen.lock().unwrap().served_all_at.expect("waited") - t0;
    eprintln!("all served {converged:?} after the first was created; settling");
    // At rest once nothing the controller decides has changed for 20 s:
    // no Service's status, no node's assignments or peers.
    wait(
        &seen,
        Duration::from_secs(900),
        "the cluster at rest",
        |s| s.last_change.elapsed() >= Duration::from_secs(20),
    )
    .await?;

    let rest_from = (api_metrics(&admin).await?, Instant::now());
    // Everything written from the first creation until the cluster is at
    // rest, counted (not a rate): divided by the Services, what one costs.
    let creation = Window::between(&creation_from, &rest_from.0, 0.0);
    let cpu_from: Vec<u64> = setup
        .controllers
        .iter()
        .map(|p| cpu_ticks(*p))
        .collect::<Result<_>>()?;
    let mut etcd = vec![EtcdSample::take(&setup.etcd_url, Duration::ZERO)?];
    for minute in 1..=args.rest_minutes {
        tokio::time::sleep_until((rest_from.1 + Duration::from_secs(60 * minute)).into()).await;
        let sample = EtcdSample::take(&setup.etcd_url, rest_from.1.elapsed())?;
        eprintln!(
            "at rest, minute {minute}: etcd {:.1} MiB ({:.1} MiB in use), {} compactions",
            mib(sample.total),
            mib(sample.in_use),
            sample.compactions
        );
        etcd.push(sample);
    }
    let rest_to = (api_metrics(&admin).await?, Instant::now());
    let secs = (rest_to.1 - rest_from.1).as_secs_f64();
    let controllers = setup
        .controllers
        .iter()
        .zip(&cpu_from)
        .map(|(pid, from)| {
            Ok(ControllerUse {
                rss_kib: rss_kib(*pid)?,
                cpu_share: (cpu_ticks(*pid)? - from) as f64 / clock_ticks_per_second() / secs,
            })
        })
        .collect::<Result<_>>()?;
    let rest = Window::between(&rest_from.0, &rest_to.0, secs);

    let failover = fail_one(&admin, &seen, &mut sims, &witnesses).await?;
    let end = api_metrics(&admin).await?;
    let whole = Window::between(&start_metrics, &end, 0.0);
    observer.abort();
    drop(sims);
    Ok(Report {
        registered,
        created,
        converged,
        rest,
        creation,
        whole,
        etcd,
        controllers,
        failover,
        denied,
        baseline,
    })
}

/// Creates `count` Services in `namespace`, `parallel` at a time: DHCP
/// LoadBalancers (`ours`), else ClusterIP Services nobody reacts to. The
/// namespace is made when it is not `default`.
async fn create_services(
    admin: &kube::Client,
    namespace: &str,
    count: usize,
    parallel: usize,
    ours: bool,
) -> Result<()> {
    if namespace != "default" {
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(admin.clone());
        let ns = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}
        }))?;
        namespaces.create(&PostParams::default(), &ns).await?;
    }
    let services: Api<Service> = Api::namespaced(admin.clone(), namespace);
    futures::stream::iter(0..count)
        .map(|i| {
            let services = services.clone();
            async move {
                let name = format!("scale-{i:05}");
                let ports = serde_json::json!([{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]);
                let body = if ours {
                    // No NodePorts: the range holds 2,768, and an L2
                    // LoadBalancer needs none.
                    serde_json::json!({
                        "apiVersion": "v1", "kind": "Service",
                        "metadata": {"name": name, "annotations": {harvester::IPAM: "dhcp"}},
                        "spec": {"type": "LoadBalancer", "selector": {"app": name}, "ports": ports,
                                 "allocateLoadBalancerNodePorts": false},
                    })
                } else {
                    serde_json::json!({
                        "apiVersion": "v1", "kind": "Service",
                        "metadata": {"name": name},
                        "spec": {"type": "ClusterIP", "selector": {"app": name}, "ports": ports},
                    })
                };
                let svc: Service = serde_json::from_value(body)?;
                // As a client creating many would: an overloaded server's
                // timeout or 5xx (or APF's 429) is tried again, and the
                // first attempt may have landed.
                let mut attempt = 0;
                loop {
                    attempt += 1;
                    match services.create(&PostParams::default(), &svc).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(e)) if e.code == 409 && attempt > 1 => break,
                        Err(e) if attempt < 5 && !matches!(&e, kube::Error::Api(a) if a.code < 500 && a.code != 429) => {
                            eprintln!("creating Service {namespace}/{name} (attempt {attempt}): {e}; again");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(e) => {
                            return Err(e).with_context(|| format!("creating Service {namespace}/{name}"));
                        }
                    }
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(parallel)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// One node may not write another's object: the bench's nodes are what
/// the API server's authorizers make of `system:node:*`, not admins.
async fn node_authorization_applies(nodes: &[(String, PathBuf)]) -> Result<String> {
    let (me, other) = (&nodes[0], &nodes[1].0);
    let client = hna_testkit::rig::kube_client(&me.1).await?;
    let api: Api<LoadBalancerNode> =
        Api::namespaced_with(client, lb::NAMESPACE, &node_object::api_resource());
    let patch = serde_json::json!({"status": {"held": 0}});
    match api
        .patch_status(other, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 403 => Ok(format!(
            "system:node:{} writing {other}'s status: 403 {}",
            me.0, s.reason
        )),
        other_result => bail!(
            "system:node:{} could write another node's status, or failed otherwise: {other_result:?}",
            me.0
        ),
    }
}

struct FailoverResult {
    victim: String,
    services: usize,
    assigned: Duration,
    bound: Duration,
    writes: BTreeMap<(String, String), f64>,
}

/// Stops the node that holds the most Services and has its witnesses
/// report it down; returns when every one of its Services is BOUND on
/// another node, as the API shows it.
async fn fail_one(
    admin: &kube::Client,
    seen: &Arc<Mutex<Seen>>,
    sims: &mut BTreeMap<String, SimNode>,
    witnesses: &BTreeMap<&str, Vec<String>>,
) -> Result<FailoverResult> {
    let (victim, held) = {
        let s = seen.lock().unwrap();
        let (victim, held) = s
            .held
            .iter()
            .max_by_key(|(n, h)| (h.len(), std::cmp::Reverse(n.as_str())))
            .context("nobody holds anything")?;
        (victim.clone(), held.clone())
    };
    eprintln!(
        "failover: {victim} (holding {}) stops; its witnesses {:?} report it",
        held.len(),
        witnesses[victim.as_str()]
    );
    let before = api_metrics(admin).await?;
    drop(sims.remove(&victim));
    let from = Instant::now();
    seen.lock().unwrap().failover = Some(FailoverSeen {
        victim: victim.clone(),
        services: held.clone(),
        assigned: HashMap::new(),
        bound: HashMap::new(),
    });
    for w in &witnesses[victim.as_str()] {
        sims.get(w).context("a witness")?.accuse(&victim);
    }
    wait(seen, Duration::from_secs(120), "the failover", |s| {
        s.failover
            .as_ref()
            .is_some_and(|f| f.bound.len() >= f.services.len())
    })
    .await?;
    let after = api_metrics(admin).await?;
    let s = seen.lock().unwrap();
    let f = s.failover.as_ref().expect("set above");
    let last = |m: &HashMap<String, Instant>| {
        m.values()
            .max()
            .map(|t| t.saturating_duration_since(from))
            .unwrap_or_default()
    };
    Ok(FailoverResult {
        victim,
        services: held.len(),
        assigned: last(&f.assigned),
        bound: last(&f.bound),
        writes: Window::between(&before, &after, 0.0).writes,
    })
}

/// A simulated node: its tasks stop when it is dropped.
struct SimNode {
    lan: watch::Sender<LanReport>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SimNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SimNode {
    fn start(
        name: String,
        index: usize,
        client: kube::Client,
        lan: LanReport,
        addresses: Arc<Addresses>,
        lease_time: Duration,
    ) -> SimNode {
        let (tx, rx) = watch::channel(lan);
        let task = tokio::spawn(sim_node(name, index, client, rx, addresses, lease_time));
        SimNode { lan: tx, task }
    }

    /// Its membership found `node` dead: listed down, no longer heard.
    fn accuse(&self, node: &str) {
        self.lan.send_modify(|l| {
            l.down.push(node.to_string());
            l.down.sort();
            l.hears.retain(|h| h != node);
            l.alive = l.alive.saturating_sub(1);
        });
    }
}

#[derive(Debug, Clone)]
struct SimLease {
    service: String,
    mac: String,
    /// Read at this instant; BOUND once the exchange is over.
    started: Instant,
    address: Option<Ipv4Addr>,
    expires: Option<SystemTime>,
    renew_at: Option<Instant>,
}

async fn sim_node(
    name: String,
    index: usize,
    client: kube::Client,
    mut lan: watch::Receiver<LanReport>,
    addresses: Arc<Addresses>,
    lease_time: Duration,
) {
    // Aborted with this task (the JoinSet's drop), as the agent's are with
    // its process.
    let mut children = tokio::task::JoinSet::new();
    let (_client_tx, client_rx) = watch::channel(Some(client.clone()));
    let writes = StatusWrites::start(
        KubeStatus {
            client: client_rx.clone(),
            namespace: lb::NAMESPACE.into(),
            node: name.clone(),
        },
        HEARTBEAT,
    );
    let (spec_tx, mut specs) = mpsc::channel(8);
    let (_relist, relist_asked) = watch::channel(0);
    children.spawn(follow(
        client_rx,
        lb::NAMESPACE.into(),
        name.clone(),
        spec_tx,
        relist_asked,
    ));
    // The agent's other watches: its Node (the topology relay) and the
    // membership key's Secret. What they bring is not used here.
    let (other_tx, mut others) = mpsc::channel::<()>(8);
    children.spawn(watch_one(
        Api::<Node>::all(client.clone()),
        name.clone(),
        WATCH_TIMEOUT_SECS,
        other_tx.clone(),
        |_| (),
    ));
    children.spawn(watch_one(
        Api::<Secret>::namespaced(client.clone(), lb::NAMESPACE),
        membership::SECRET_NAME.into(),
        WATCH_TIMEOUT_SECS,
        other_tx,
        |_| (),
    ));
    children.spawn(conditions(client, name.clone()));

    let mac = format!("52:54:00:{:02x}:{:02x}:01", index / 256, index % 256);
    let mut assignments: Option<Vec<Assignment>> = None;
    let mut observed: Option<i64> = None;
    let mut leases: BTreeMap<String, SimLease> = BTreeMap::new();
    let far = Instant::now() + Duration::from_secs(86_400 * 365);
    let mut bind_due: Option<Instant> = None;
    let mut renewals = tokio::time::interval_at(
        (Instant::now() + Duration::from_millis(fastrand::u64(0..1000))).into(),
        Duration::from_secs(1),
    );
    loop {
        let mut changed = false;
        tokio::select! {
            u = specs.recv() => match u {
                Some(SpecRead { update: Update::Present(spec), generation, .. }) => {
                    observed = observed.max(generation);
                    let now = Instant::now();
                    let wanted: BTreeMap<&str, &Assignment> = spec
                        .assignments
                        .iter()
                        .filter(|a| !a.release)
                        .map(|a| (a.interface.as_str(), a))
                        .collect();
                    leases.retain(|i, _| wanted.contains_key(i.as_str()));
                    for (interface, a) in &wanted {
                        leases.entry(interface.to_string()).or_insert_with(|| {
                            bind_due = Some(bind_due.unwrap_or(now + DHCP_EXCHANGE));
                            SimLease {
                                service: a.service.clone(),
                                mac: a.mac.clone(),
                                started: now,
                                address: a
                                    .requested_ip
                                    .as_deref()
                                    .and_then(|ip| ip.parse().ok()),
                                expires: None,
                                renew_at: None,
                            }
                        });
                    }
                    assignments = Some(spec.assignments);
                    changed = true;
                }
                Some(_) => {}
                None => return,
            },
            Some(()) = others.recv() => {}
            r = lan.changed() => {
                if r.is_err() {
                    return;
                }
                changed = true;
            }
            _ = tokio::time::sleep_until(bind_due.unwrap_or(far).into()), if bind_due.is_some() => {
                let now = Instant::now();
                bind_due = None;
                for l in leases.values_mut().filter(|l| l.expires.is_none()) {
                    if now >= l.started + DHCP_EXCHANGE {
                        l.address = Some(l.address.unwrap_or_else(|| addresses.of(&l.service)));
                        l.expires = Some(SystemTime::now() + lease_time);
                        l.renew_at = Some(now + lease_time / 2);
                        changed = true;
                    } else {
                        let due = l.started + DHCP_EXCHANGE;
                        bind_due = Some(bind_due.map_or(due, |d| d.min(due)));
                    }
                }
            }
            _ = renewals.tick() => {
                let now = Instant::now();
                for l in leases.values_mut() {
                    if l.renew_at.is_some_and(|r| now >= r) {
                        l.expires = Some(SystemTime::now() + lease_time);
                        l.renew_at = Some(now + lease_time / 2);
                        changed = true;
                    }
                }
            }
        }
        if changed && assignments.is_some() {
            writes.draft(status(&leases, &mac, &lan.borrow(), observed));
        }
    }
}

/// The status as the agent drafts it (`loadbalancer::task::report`'s shape).
fn status(
    leases: &BTreeMap<String, SimLease>,
    mac: &str,
    lan: &LanReport,
    observed_generation: Option<i64>,
) -> Status {
    let reports: Vec<LeaseReport> = leases
        .iter()
        .map(|(interface, l)| LeaseReport {
            service: l.service.clone(),
            interface: interface.clone(),
            state: if l.expires.is_some() {
                "BOUND"
            } else {
                "SELECTING"
            }
            .into(),
            address: l.expires.and(l.address).map(|a| a.to_string()),
            server: l.expires.map(|_| GATEWAY.to_string()),
            expires: l
                .expires
                .map(|e| humantime::format_rfc3339_millis(e).to_string()),
            mac: l.mac.clone(),
            message: None,
        })
        .collect();
    let held: Vec<&LeaseReport> = reports.iter().filter(|r| r.state == "BOUND").collect();
    Status {
        heartbeat: None,
        heartbeat_period_ms: Some(HEARTBEAT.as_millis() as u64),
        restart_grace_ms: None,
        observed_generation,
        ready: true,
        reason: "Ready".into(),
        macvlan_ready: true,
        default_uplink: Some("eth0".into()),
        nic_macs: vec![mac.to_string()],
        gateway_mac: Some("52:54:00:ff:ff:fe".into()),
        dhcp_server_macs: Vec::new(),
        gateway_address: Some(GATEWAY.into()),
        held: held.len() as u32,
        addresses: held
            .iter()
            .filter_map(|r| Some(format!("{} ({})", r.address.as_ref()?, r.service)))
            .collect::<Vec<_>>()
            .join(", "),
        leases: reports,
        agent_version: "simulated".into(),
        lan: Some(lan.clone()),
        conditions: Vec::new(),
    }
}

/// The agent's Node conditions: at start, then looked at every
/// `node_conditions::RECHECK`, from a phase of its own.
async fn conditions(client: kube::Client, name: String) {
    let wanted = [node_conditions::Condition {
        type_: "MacvlanReady".into(),
        ready: true,
        reason: "ModuleAvailable".into(),
        message: "macvlan is available".into(),
    }];
    node_conditions::reconcile(&client, &name, &wanted, false).await;
    let period = node_conditions::RECHECK;
    tokio::time::sleep(period.mul_f64(fastrand::f64())).await;
    loop {
        node_conditions::reconcile(&client, &name, &wanted, false).await;
        tokio::time::sleep(period).await;
    }
}

/// A Service's address, the same whichever node asks (a DHCP server's
/// reservation by client identifier).
#[derive(Default)]
struct Addresses(Mutex<HashMap<String, Ipv4Addr>>);

impl Addresses {
    fn of(&self, service: &str) -> Ipv4Addr {
        let mut m = self.0.lock().unwrap();
        let n = m.len() as u32;
        *m.entry(service.to_string())
            .or_insert_with(|| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + n))
    }
}

fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 64, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// What an admin's watches see of the Services and the nodes' objects.
struct Seen {
    want_served: usize,
    served: HashSet<String>,
    served_all_at: Option<Instant>,
    with_status: HashSet<String>,
    /// Services BOUND in each node's status.
    held: HashMap<String, BTreeSet<String>>,
    /// Each node's assignments and peers, to tell when they last changed.
    specs: HashMap<String, (BTreeSet<String>, usize)>,
    last_change: Instant,
    failover: Option<FailoverSeen>,
}

struct FailoverSeen {
    victim: String,
    services: BTreeSet<String>,
    assigned: HashMap<String, Instant>,
    bound: HashMap<String, Instant>,
}

impl Seen {
    fn new(want_served: usize) -> Seen {
        Seen {
            want_served,
            served: HashSet::new(),
            served_all_at: None,
            with_status: HashSet::new(),
            held: HashMap::new(),
            specs: HashMap::new(),
            last_change: Instant::now(),
            failover: None,
        }
    }

    fn service(&mut self, svc: &Service) {
        let Some(name) = svc.metadata.name.as_deref() else {
            return;
        };
        let key = format!("default/{name}");
        let served = lb::ingress_ip(svc).is_some();
        let changed = if served {
            self.served.insert(key)
        } else {
            self.served.remove(&key)
        };
        if changed {
            self.last_change = Instant::now();
        }
        if self.served.len() >= self.want_served && self.served_all_at.is_none() {
            self.served_all_at = Some(Instant::now());
        }
    }

    fn node(&mut self, o: &LoadBalancerNode) {
        let Some(name) = o.metadata.name.clone() else {
            return;
        };
        let now = Instant::now();
        let assigned: BTreeSet<String> = o
            .spec
            .assignments
            .iter()
            .filter(|a| !a.release)
            .map(|a| a.service.clone())
            .collect();
        let held: BTreeSet<String> = o
            .status
            .as_ref()
            .map(|s| {
                s.leases
                    .iter()
                    .filter(|l| l.state == "BOUND")
                    .map(|l| l.service.clone())
                    .collect()
            })
            .unwrap_or_default();
        if o.status.as_ref().is_some_and(|s| s.lan.is_some()) {
            self.with_status.insert(name.clone());
        }
        if let Some(f) = self.failover.as_mut().filter(|f| f.victim != name) {
            for s in f.services.iter() {
                if assigned.contains(s) {
                    f.assigned.entry(s.clone()).or_insert(now);
                }
                if held.contains(s) {
                    f.bound.entry(s.clone()).or_insert(now);
                }
            }
        }
        let spec = (assigned, o.spec.peers.len());
        if self.specs.get(&name) != Some(&spec) {
            self.last_change = now;
            self.specs.insert(name.clone(), spec);
        }
        self.held.insert(name, held);
    }
}

async fn observe(admin: kube::Client, seen: Arc<Mutex<Seen>>) {
    let services: Api<Service> = Api::namespaced(admin.clone(), "default");
    let nodes: Api<LoadBalancerNode> =
        Api::namespaced_with(admin, lb::NAMESPACE, &node_object::api_resource());
    let cfg = watcher::Config::default();
    let svc = watcher(services, cfg.clone()).for_each(|e| {
        if let Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) = e {
            seen.lock().unwrap().service(&s);
        }
        futures::future::ready(())
    });
    let lbn = watcher(nodes, cfg).for_each(|e| {
        if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = e {
            seen.lock().unwrap().node(&o);
        }
        futures::future::ready(())
    });
    futures::join!(svc, lbn);
}

async fn wait(
    seen: &Mutex<Seen>,
    within: Duration,
    what: &str,
    done: impl Fn(&Seen) -> bool,
) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        {
            let s = seen.lock().unwrap();
            if done(&s) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{what}: not within {within:?} ({} Services served, {} nodes reporting)",
                    s.served.len(),
                    s.with_status.len()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn api_metrics(admin: &kube::Client) -> Result<Vec<Sample>> {
    let req = kube::core::Request::new("/metrics")
        .list(&Default::default())
        .context("a /metrics request")?;
    Ok(parse_metrics(&admin.request_text(req).await?))
}

/// The API server's counters between two scrapes.
struct Window {
    /// Mutating requests per second (per request when `secs` is 0: the
    /// counts), by resource (`resource/subresource`) and verb.
    writes: BTreeMap<(String, String), f64>,
    /// Mutating requests answered with a code other than 2xx.
    failed: f64,
    /// p99 of the mutating requests' latency, from the histogram.
    p99: Option<f64>,
    rejected: f64,
}

impl Window {
    fn between(from: &[Sample], to: &[Sample], secs: f64) -> Window {
        let mutating = is_write;
        let key = |s: &Sample| {
            let r = s.labels.get("resource").cloned().unwrap_or_default();
            let sub = s.labels.get("subresource").cloned().unwrap_or_default();
            let r = if sub.is_empty() {
                r
            } else {
                format!("{r}/{sub}")
            };
            (r, s.labels.get("verb").cloned().unwrap_or_default())
        };
        let delta = |name: &str, keep: &dyn Fn(&Sample) -> bool| {
            let mut m: BTreeMap<(String, String, String), f64> = BTreeMap::new();
            for (sign, samples) in [(-1.0, from), (1.0, to)] {
                for s in samples.iter().filter(|s| s.name == name && keep(s)) {
                    let (r, v) = key(s);
                    let extra = s
                        .labels
                        .get("le")
                        .or_else(|| s.labels.get("code"))
                        .cloned()
                        .unwrap_or_default();
                    *m.entry((r, v, extra)).or_default() += sign * s.value;
                }
            }
            m
        };
        let counts = delta("apiserver_request_total", &mutating);
        let mut writes = BTreeMap::new();
        let mut failed = 0.0;
        for ((r, v, code), n) in &counts {
            *writes.entry((r.clone(), v.clone())).or_default() +=
                if secs > 0.0 { n / secs } else { *n };
            if !code.starts_with('2') {
                failed += n;
            }
        }
        writes.retain(|_, n| *n > 0.0);
        let mut buckets: BTreeMap<u64, f64> = BTreeMap::new();
        for ((_, _, le), n) in delta("apiserver_request_duration_seconds_bucket", &mutating) {
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            *buckets.entry(le.to_bits()).or_default() += n;
        }
        let mut buckets: Vec<(f64, f64)> = buckets
            .into_iter()
            .map(|(b, n)| (f64::from_bits(b), n))
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let rejected = sum(to, "apiserver_flowcontrol_rejected_requests_total", |_| {
            true
        }) - sum(
            from,
            "apiserver_flowcontrol_rejected_requests_total",
            |_| true,
        );
        Window {
            writes,
            failed,
            p99: quantile(&buckets, 0.99),
            rejected,
        }
    }

    fn total(&self) -> f64 {
        self.writes.values().sum()
    }
}

struct EtcdSample {
    at: Duration,
    total: f64,
    in_use: f64,
    compactions: u64,
}

impl EtcdSample {
    fn take(etcd_url: &str, at: Duration) -> Result<EtcdSample> {
        use std::io::{Read, Write};
        let addr = etcd_url
            .strip_prefix("http://")
            .context("etcd's URL is http://")?;
        let mut s = std::net::TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        let m = parse_metrics(&out);
        Ok(EtcdSample {
            at,
            total: sum(&m, "etcd_mvcc_db_total_size_in_bytes", |_| true),
            in_use: sum(&m, "etcd_mvcc_db_total_size_in_use_in_bytes", |_| true),
            // One observation per compaction that etcd ran.
            compactions: sum(
                &m,
                "etcd_debugging_mvcc_db_compaction_total_duration_milliseconds_count",
                |_| true,
            ) as u64,
        })
    }
}

struct ControllerUse {
    rss_kib: u64,
    cpu_share: f64,
}

fn mib(bytes: f64) -> f64 {
    bytes / 1024.0 / 1024.0
}

impl Report {
    fn print(&self, args: &Args, setup: &Setup) {
        let (n, s) = (args.nodes, args.services);
        println!(
            "\n{n} nodes (simulated, each with its own system:node credentials), {s} DHCP Services, \
             {} controller replicas, kube-apiserver {} with etcd on tmpfs",
            args.controllers, setup.version
        );
        println!("node authorization: {}", self.denied);
        if let Some(pace) = self.baseline {
            println!(
                "the API server's own pace on this machine: {pace:.0} ClusterIP Services created per second ({} at a time, nobody reacting)",
                args.create_parallel
            );
        }
        println!(
            "{n} Nodes registered and every node's first status written: {:.1} s",
            self.registered.as_secs_f64()
        );
        println!(
            "{s} Services created in {:.1} s ({} at a time, {:.0} per second); the last has an address {:.1} s after the first was created, {:.1} s after the last was",
            self.created.as_secs_f64(),
            args.create_parallel,
            s as f64 / self.created.as_secs_f64(),
            self.converged.as_secs_f64(),
            (self.converged.saturating_sub(self.created)).as_secs_f64()
        );
        println!(
            "\nAPI writes from the first Service created until at rest, per Service (every writer, the node backstop included):"
        );
        println!("| resource | verb | per Service |\n|---|---|---|");
        for ((r, v), count) in &self.creation.writes {
            println!("| {r} | {v} | {:.2} |", count / s as f64);
        }
        println!(
            "| **all** | | **{:.2}** |",
            self.creation.total() / s as f64
        );
        let rest_minutes = args.rest_minutes;
        println!(
            "\nAPI writes per second at rest, {rest_minutes} minutes (the API server's own counters, every writer):"
        );
        println!("| resource | verb | per second |\n|---|---|---|");
        for ((r, v), rate) in &self.rest.writes {
            println!("| {r} | {v} | {rate:.2} |");
        }
        println!(
            "| **all** | | **{:.2}** (goal: at most 0.1 × {n} + 2.5 = {:.1}) |",
            self.rest.total(),
            0.1 * n as f64 + 2.5
        );
        let p99 = |w: &Window| {
            w.p99
                .map(|p| format!("{:.0} ms", p * 1000.0))
                .unwrap_or_else(|| "no request".into())
        };
        println!(
            "p99 latency of mutating requests: at rest {}, over the whole run {}",
            p99(&self.rest),
            p99(&self.whole)
        );
        println!(
            "mutating requests that failed: at rest {}, whole run {}",
            self.rest.failed, self.whole.failed
        );
        println!(
            "APF rejections (apiserver_flowcontrol_rejected_requests_total), whole run: {}",
            self.whole.rejected
        );
        println!("\netcd's database at rest (etcd's own gauges):");
        println!("| minute | size | in use | compactions so far |\n|---|---|---|---|");
        for e in &self.etcd {
            println!(
                "| {:.0} | {:.1} MiB | {:.1} MiB | {} |",
                e.at.as_secs_f64() / 60.0,
                mib(e.total),
                mib(e.in_use),
                e.compactions
            );
        }
        for (i, c) in self.controllers.iter().enumerate() {
            println!(
                "controller replica {i}: VmRSS {:.1} MiB, CPU {:.1} % of one core at rest",
                c.rss_kib as f64 / 1024.0,
                c.cpu_share * 100.0
            );
        }
        let f = &self.failover;
        println!(
            "\nfailover of {} holding {} Services, from its witnesses' reports: all assigned elsewhere after {:.2} s, all BOUND on their new nodes (as the API shows) after {:.2} s",
            f.victim,
            f.services,
            f.assigned.as_secs_f64(),
            f.bound.as_secs_f64()
        );
        println!(
            "writes it took: {}",
            f.writes
                .iter()
                .map(|((r, v), n)| format!("{r} {v} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
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
