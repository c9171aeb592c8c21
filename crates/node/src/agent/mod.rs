//! `harvester-node-agent run`: orchestration of the node daemon.
//!
//! Start-up order matters to systemd: configuration is validated before this
//! module is entered; here the state directory and control socket are set up,
//! then `READY=1` is sent. The cluster connection is not part of readiness:
//! the daemon must do its local work on a node that has not joined yet.
//!
//! One task per subsystem, sharing a small [`Context`]:
//! - `macvlan`: the preflight and its re-checks;
//! - the guest-agent watch ([`crate::guest::watch`]);
//! - the credentials watcher ([`hna_edges::cluster::connection`]);
//! - the topology relay ([`crate::topology`]);
//! - `conditions`: this node's Node conditions;
//! - [`lb`]: the LoadBalancer addresses this node's `LoadBalancerNode`
//!   assigns, held through the DHCP engine, and that object's status;
//! - `publish`: the `STATUS=` line;
//! - the control socket and the optional metrics endpoint.

mod conditions;
pub mod daemon_state;
mod macvlan;
pub mod metrics;
mod publish;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::control;
use crate::guest::{self, GuestAgentState};
use crate::kmod::MacvlanState;
use crate::node_conditions::Reported;
use daemon_state::{AgentStatus, LbStatus, StateDirStatus};
use hna_edges::cluster::connection::{self, ClusterState, WatchOptions};
use hna_edges::cluster::credentials::{self, HostEnv};
use hna_edges::systemd::{self, Liveness, Notifier};

/// How long the work before `READY=1` may take: the macvlan preflight and
/// the first qemu-guest-agent assessment, which run side by side. What is
/// unfinished by then is reported as `Checking` (in `STATUS=`, `status` and
/// the Node conditions) and completes after READY. Well below the unit's
/// `TimeoutStartSec=60`, so a slow module load never gets the daemon killed.
/// The rest of start-up (state directory, control socket, the DHCP
/// engine) is local and takes milliseconds.
pub const READY_BUDGET: Duration = Duration::from_secs(20);

/// How long one API health request may take before the cluster counts as
/// unreachable.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// What every task of the daemon shares.
#[derive(Clone)]
pub struct Context {
    pub node: String,
    /// How often a task beats while it waits.
    pub beat_every: Duration,
    pub liveness: Liveness,
    /// Changes once, when the daemon stops.
    pub shutdown: watch::Receiver<bool>,
    /// The histograms the tasks observe into.
    pub metrics: metrics::AgentMetrics,
}

/// Runs until SIGTERM or SIGINT.
pub async fn run(cfg: Config, notifier: Arc<dyn Notifier>) -> anyhow::Result<()> {
    let started = SystemTime::now();
    let watchdog = systemd::watchdog_period();
    let beat_every = systemd::heartbeat_interval(watchdog);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        node = %cfg.node_name,
        config = ?cfg.file,
        state_dir = %cfg.state_dir.display(),
        socket = %cfg.socket.display(),
        watchdog = ?watchdog,
        "starting harvester-node-agent"
    );
    // Handlers first: a SIGTERM that arrives during start-up must still
    // mean a clean stop, not the default disposition.
    let mut signals = Signals::install()?;
    let start = start_up(&cfg).await?;

    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let ctx = Context {
        node: cfg.node_name.clone(),
        beat_every,
        liveness: Liveness::default(),
        shutdown: shutdown_rx.clone(),
        metrics: start.agent_metrics.clone(),
    };
    let settings = cfg.credential_settings();
    let topology_cfg = crate::topology::TopologyConfig::from_config(&cfg);
    let (cluster_tx, cluster_rx) = watch::channel(ClusterState::initial(&credentials::discover(
        &settings, &HostEnv,
    )));
    let (macvlan_tx, macvlan_rx) = watch::channel(start.macvlan);
    let (guest_tx, guest_rx) = watch::channel(start.guest);
    let (client_tx, client_rx) = watch::channel::<Option<kube::Client>>(None);
    let (conditions_tx, conditions_rx) = watch::channel(Reported::NotConnected);
    let (topology_tx, topology_rx) = watch::channel(topology_cfg.initial_state());
    let (recheck_tx, recheck_rx) = mpsc::channel::<()>(1);
    let (lb_tx, lb_rx) = watch::channel(LbStatus::default());
    let snapshot = Snapshot {
        node: cfg.node_name.clone(),
        started,
        state_dir: StateDirStatus {
            path: cfg.state_dir.clone(),
            ok: true,
            message: "writable".into(),
        },
        dhcp_at_start: start.dhcp_at_start,
        engine: start.engine.clone(),
        cluster: cluster_rx.clone(),
        macvlan: macvlan_rx.clone(),
        guest: guest_rx.clone(),
        topology: topology_rx.clone(),
        conditions: conditions_rx,
        lb: lb_rx.clone(),
    };

    let mut tasks = tokio::task::JoinSet::new();
    if let Some(l) = start.metrics {
        tasks.spawn(serve_metrics(ctx.clone(), l, snapshot.clone()));
    }
    tasks.spawn(serve_control(ctx.clone(), start.control, snapshot.clone()));
    tasks.spawn(connection::watch(
        WatchOptions {
            settings,
            every: cfg.credentials_retry,
            api_timeout: API_TIMEOUT,
            beat_every,
        },
        HostEnv,
        cluster_tx,
        client_tx,
        ctx.liveness.register("credentials"),
        shutdown_rx.clone(),
    ));
    tasks.spawn(macvlan::recheck(
        ctx.clone(),
        cfg.macvlan_recheck,
        start.macvlan_pending,
        macvlan_tx,
        recheck_rx,
    ));
    tasks.spawn(watch_guest_agent(
        ctx.clone(),
        start.systemd_bus,
        start.guest_pending,
        guest_tx,
    ));
    tasks.spawn(crate::topology::run(
        topology_cfg,
        client_rx.clone(),
        cfg.node_name.clone(),
        topology_tx,
        shutdown_rx.clone(),
    ));
    spawn_lb(
        &mut tasks,
        &ctx,
        &cfg,
        start.engine.clone(),
        client_rx.clone(),
        macvlan_rx.clone(),
        lb_tx,
    );
    tasks.spawn(conditions::report(
        ctx.clone(),
        cfg.credentials_retry,
        client_rx,
        macvlan_rx.clone(),
        guest_rx.clone(),
        conditions_tx,
    ));
    // READY=1 first, then the first STATUS=, then watchdog pings: the order
    // a service manager (and a reader of `systemctl status`) expects.
    notifier.ready();
    tracing::info!(summary = %snapshot.take().summary, "ready");
    tasks.spawn(publish::status_line(
        notifier.clone(),
        publish::Sources {
            cluster: cluster_rx,
            macvlan: macvlan_rx,
            guest: guest_rx,
            topology: topology_rx,
            lb: lb_rx,
        },
        move || snapshot.take(),
        shutdown_rx.clone(),
    ));
    if let Some(period) = watchdog {
        tasks.spawn(systemd::run_watchdog(
            notifier.clone(),
            ctx.liveness.clone(),
            period,
            shutdown_rx,
        ));
    }

    let signal_name = signals
        .until_stop(&ctx.liveness.register("main"), beat_every, &recheck_tx)
        .await;
    tracing::info!(signal = signal_name, "stopping");
    notifier.stopping();
    notifier.status(&format!("stopping ({signal_name})"));
    let _ = shutdown_tx.send(true);
    // The LoadBalancer task decides what its leases become (handed over,
    // or left on their links for a restart): it goes first.
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(10), drain)
        .await
        .is_err()
    {
        tracing::warn!("some tasks did not stop within 10s; exiting anyway");
    }
    // Whatever still runs (that task gone early): a handover, never a
    // release, so the address stays the Service's wherever it goes next.
    for e in start.engine.stop_all(hna_dhcp::StopMode::Handover).await {
        tracing::warn!(error = %e, "could not stop a DHCP lease cleanly");
    }
    let _ = std::fs::remove_file(&cfg.socket);
    tracing::info!("stopped");
    Ok(())
}

/// The signals the daemon acts on.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("installing SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing SIGINT handler")?,
            hup: signal(SignalKind::hangup()).context("installing SIGHUP handler")?,
        })
    }

    /// Beats `main` until SIGTERM or SIGINT (returned by name); SIGHUP asks
    /// for a macvlan re-check.
    async fn until_stop(
        &mut self,
        main: &systemd::Heartbeat,
        beat_every: Duration,
        recheck: &mpsc::Sender<()>,
    ) -> &'static str {
        let mut tick = tokio::time::interval(beat_every);
        loop {
            tokio::select! {
                _ = self.term.recv() => return "SIGTERM",
                _ = self.int.recv() => return "SIGINT",
                _ = self.hup.recv() => {
                    tracing::info!("SIGHUP: re-running the macvlan preflight");
                    // A full queue means a re-check is already pending.
                    let _ = recheck.try_send(());
                }
                _ = tick.tick() => main.beat(),
            }
        }
    }
}

/// What start-up hands to the running daemon.
struct StartUp {
    metrics: Option<tokio::net::TcpListener>,
    agent_metrics: metrics::AgentMetrics,
    control: tokio::net::UnixListener,
    engine: Arc<hna_dhcp::engine::Engine>,
    dhcp_at_start: daemon_state::DhcpStatus,
    macvlan: MacvlanState,
    macvlan_pending: Option<JoinHandle<MacvlanState>>,
    guest: GuestAgentState,
    systemd_bus: Option<Option<guest::units::Systemd>>,
    guest_pending: Option<GuestSetup>,
}

type GuestSetup = JoinHandle<(Option<guest::units::Systemd>, GuestAgentState)>;

/// Everything before `READY=1`, in an order that changes nothing on the
/// host before it must, and takes at most [`READY_BUDGET`] for the slow
/// parts.
async fn start_up(cfg: &Config) -> anyhow::Result<StartUp> {
    let started_at = tokio::time::Instant::now();
    // Binding changes nothing on the host, so a taken port stops start-up
    // before the state directory or any link is touched.
    let metrics = match cfg.metrics_listen {
        Some(addr) => Some(hna_edges::metrics::bind(addr).await.with_context(|| {
            format!(
                "metrics_listen {addr}: cannot listen there; choose a free port or leave metrics_listen unset"
            )
        })?),
        None => None,
    };
    crate::state_dir::prepare(&cfg.state_dir)?;
    let control = control::bind(&cfg.socket).await?;

    // The slow parts begin now and run beside the rest.
    let macvlan_first = tokio::spawn(macvlan::run_preflight());
    let guest_first = tokio::spawn(async {
        let systemd = guest::watch::connect_systemd().await;
        let state = guest::watch::assess_with(Path::new("/"), systemd.as_ref()).await;
        (systemd, state)
    });
    let agent_metrics = metrics::AgentMetrics::default();
    let (engine, dhcp_at_start) = start_dhcp(cfg, metrics.as_ref(), &agent_metrics).await?;

    // READY=1 waits for them only until the budget is spent.
    let deadline = started_at + READY_BUDGET;
    let (macvlan, macvlan_pending) = within(deadline, macvlan_first).await;
    let macvlan = macvlan.unwrap_or_else(|| {
        MacvlanState::checking(format!(
            "the macvlan preflight is still running after {}; its result follows",
            humantime::format_duration(READY_BUDGET)
        ))
    });
    macvlan::log(&macvlan);
    let (guest, guest_pending) = within(deadline, guest_first).await;
    let (systemd_bus, guest) = match guest {
        Some((bus, state)) => (Some(bus), state),
        None => (
            None,
            GuestAgentState::checking(format!(
                "the first qemu-guest-agent assessment is still running after {}; its result follows",
                humantime::format_duration(READY_BUDGET)
            )),
        ),
    };
    Ok(StartUp {
        metrics,
        agent_metrics,
        control,
        engine,
        dhcp_at_start,
        macvlan,
        macvlan_pending,
        guest,
        systemd_bus,
        guest_pending,
    })
}

/// The daemon's live state, assembled on demand for `status`, `/metrics`
/// and `STATUS=` from the subsystems' channels.
#[derive(Clone)]
struct Snapshot {
    node: String,
    started: SystemTime,
    state_dir: StateDirStatus,
    dhcp_at_start: daemon_state::DhcpStatus,
    engine: Arc<hna_dhcp::engine::Engine>,
    cluster: watch::Receiver<ClusterState>,
    macvlan: watch::Receiver<MacvlanState>,
    guest: watch::Receiver<GuestAgentState>,
    topology: watch::Receiver<crate::topology::TopologyState>,
    conditions: watch::Receiver<Reported>,
    lb: watch::Receiver<LbStatus>,
}

impl Snapshot {
    fn take(&self) -> AgentStatus {
        let cluster = self.cluster.borrow().clone();
        let macvlan = self.macvlan.borrow().clone();
        let guest_agent = self.guest.borrow().clone();
        let topology = self.topology.borrow().clone();
        let lb = self.lb.borrow().clone();
        AgentStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            node_name: self.node.clone(),
            started_at: humantime::format_rfc3339_seconds(self.started).to_string(),
            uptime_seconds: self.started.elapsed().map(|d| d.as_secs()).unwrap_or(0),
            summary: publish::summary(&publish::Summary {
                node: &self.node,
                state_dir: &self.state_dir,
                cluster: &cluster,
                macvlan: &macvlan,
                guest: &guest_agent,
                topology: &topology,
                lb: &lb,
            }),
            state_dir: self.state_dir.clone(),
            cluster,
            macvlan,
            guest_agent,
            topology,
            node_conditions: self.conditions.borrow().clone(),
            dhcp: daemon_state::DhcpStatus {
                leases: self.engine.snapshot(),
                ..self.dhcp_at_start.clone()
            },
            lb,
        }
    }
}

/// The task's output if it finishes by `deadline`; otherwise `None` and the
/// still-running task.
async fn within<T>(
    deadline: tokio::time::Instant,
    mut task: JoinHandle<T>,
) -> (Option<T>, Option<JoinHandle<T>>) {
    match tokio::time::timeout_at(deadline, &mut task).await {
        Ok(Ok(out)) => (Some(out), None),
        // A panicked start-up task: the subsystem's own loop starts afresh.
        Ok(Err(e)) => {
            tracing::error!(error = %e, "a start-up check failed");
            (None, None)
        }
        Err(_) => (None, Some(task)),
    }
}

/// The LoadBalancer task and the watch of this node's object it reads.
fn spawn_lb(
    tasks: &mut tokio::task::JoinSet<()>,
    ctx: &Context,
    cfg: &Config,
    engine: Arc<hna_dhcp::engine::Engine>,
    client: watch::Receiver<Option<kube::Client>>,
    macvlan: watch::Receiver<MacvlanState>,
    out: watch::Sender<LbStatus>,
) {
    let (tx, rx) = mpsc::channel(16);
    let (relist, relist_asked) = watch::channel(0);
    tasks.spawn(crate::loadbalancer::task::follow(
        client.clone(),
        cfg.namespace.clone(),
        cfg.node_name.clone(),
        tx,
        relist_asked,
    ));
    let uplink = cfg.uplink.clone();
    let last_uplink = std::sync::Mutex::new(None::<String>);
    let last_gateway = std::sync::Mutex::new(None::<((String, std::net::Ipv4Addr), String)>);
    let node = move || {
        let m = macvlan.borrow();
        let sys_class_net = std::path::Path::new("/sys/class/net");
        // Read once: the uplink and the gateway come from the same table.
        let routes = std::fs::read_to_string(hna_dhcp::link::ROUTE_TABLE).ok();
        let default_uplink = {
            let mut last = last_uplink.lock().unwrap_or_else(|p| p.into_inner());
            let now = hna_dhcp::link::current_uplink(
                uplink.as_deref(),
                routes
                    .as_deref()
                    .and_then(hna_dhcp::link::default_route_interface),
                last.as_deref(),
                |name| sys_class_net.join(name).exists(),
            );
            last.clone_from(&now);
            now
        };
        let neighbours = std::fs::read_to_string(hna_dhcp::link::ARP_TABLE)
            .map(|t| hna_dhcp::link::arp_neighbours(&t))
            .unwrap_or_default();
        // Kept while the gateway stays the same: its ARP entry comes and
        // goes with traffic, and `status.gatewayMac` should not.
        let gateway = routes.as_deref().and_then(hna_dhcp::link::default_gateway);
        let gateway_address = gateway.as_ref().map(|(_, gw)| *gw);
        let gateway_mac = {
            let mut last = last_gateway.lock().unwrap_or_else(|p| p.into_inner());
            let seen = gateway.as_ref().and_then(|(dev, gw)| {
                neighbours
                    .iter()
                    .find(|(_, at)| at.contains(&(*gw, dev.clone())))
                    .map(|(mac, _)| mac.clone())
            });
            *last = match (gateway, seen, last.take()) {
                (Some(gw), Some(mac), _) => Some((gw, mac)),
                (Some(gw), None, Some((was, mac))) if was == gw => Some((gw, mac)),
                _ => None,
            };
            last.as_ref().map(|(_, mac)| mac.clone())
        };
        let mut no_carrier =
            hna_dhcp::link::without_carrier(sys_class_net, hna_contract::INTERFACE_PREFIX);
        // A configured uplink that does not exist (deleted, not yet made
        // again by the network service) carries nothing either: its leases
        // are handed over at once, not retried on it.
        if let Some(u) = &default_uplink
            && !sys_class_net.join(u).exists()
        {
            no_carrier.insert(u.clone());
        }
        crate::loadbalancer::task::NodeView {
            macvlan_ready: m.ready,
            macvlan_reason: m.short(),
            default_uplink,
            no_carrier,
            nics: hna_dhcp::link::network_cards(
                std::path::Path::new("/sys/class/net"),
                hna_contract::INTERFACE_PREFIX,
            ),
            own_macs: hna_dhcp::link::interface_macs(
                std::path::Path::new("/sys/class/net"),
                hna_contract::INTERFACE_PREFIX,
            ),
            neighbours,
            gateway_mac,
            gateway_address,
        }
    };
    let settings = crate::loadbalancer::task::LbSettings {
        object: format!("{}/{}", cfg.namespace, cfg.node_name),
        heartbeat: cfg.lb_heartbeat,
        fence_after: cfg.lb_fence_after,
        restart_grace: cfg.lb_restart_grace,
        keep_on_stop: cfg.lb_keep_on_stop,
        adoption_wait: crate::loadbalancer::task::ADOPTION_WAIT,
        settle: crate::loadbalancer::task::SETTLE,
        leases: crate::loadbalancer::apply::Settings {
            timing: hna_dhcp::Timing {
                arp_probe: cfg.lb_arp_probe,
                address_lifetime: (!cfg.lb_address_lifetime.is_zero())
                    .then_some(cfg.lb_address_lifetime),
                ..hna_dhcp::Timing::default()
            },
            takeover_guard: cfg.lb_takeover_guard,
            presence: cfg.lb_presence,
            ..crate::loadbalancer::apply::Settings::default()
        },
        takeover_guard_wait: ctx.metrics.takeover_guard_wait.clone(),
    };
    let lan = spawn_membership(tasks, cfg, client.clone(), ctx.shutdown.clone());
    let (pause_tx, pauses) = watch::channel(None);
    if let Some(clock) = cfg.lb_pause_clock.clone() {
        // A pause as long as the address lifetime: every Service address
        // of this node goes silent at once, before the LoadBalancer task
        // hands them over (`crate::loadbalancer::task::Lb::after_pause`), which deletes the links.
        let on_long = crate::pause::OnLongPause {
            from: crate::loadbalancer::task::lan_wait(cfg.lb_address_lifetime),
            act: Box::new(|at_least| {
                let (down, failed) = hna_dhcp::link::set_down_now(hna_contract::INTERFACE_PREFIX);
                tracing::warn!(at_least = ?at_least, links = ?down, "this VM was paused for as long as its address lifetime or longer: every LoadBalancer link set down at once");
                for (link, e) in failed {
                    tracing::warn!(%link, error = %e, "could not set the link down after the pause");
                }
            }),
        };
        if let Err(e) = crate::pause::spawn(clock, pause_tx, Some(on_long)) {
            tracing::warn!(error = %e, "cannot start the pause watch: pauses of this VM (live migration, suspend) go unseen");
        }
    }
    let writer = crate::loadbalancer::task::KubeStatus {
        client,
        namespace: cfg.namespace.clone(),
        node: cfg.node_name.clone(),
    };
    tasks.spawn(crate::loadbalancer::task::run_loop(
        engine,
        writer,
        settings,
        node,
        rx,
        out,
        ctx.liveness.register("loadbalancer"),
        ctx.beat_every,
        lan,
        pauses,
        relist,
        ctx.shutdown.clone(),
    ));
}

/// How often the default uplink's address is looked at for the membership.
const UPLINK_ADDRESS_POLL: Duration = Duration::from_secs(1);

/// The LAN membership (`crate::membership`), the watch of its key (the
/// Secret, which this node's Role may read) and the poll of the address it
/// listens on; returns the LoadBalancer task's side of it.
fn spawn_membership(
    tasks: &mut tokio::task::JoinSet<()>,
    cfg: &Config,
    client: watch::Receiver<Option<kube::Client>>,
    shutdown: watch::Receiver<bool>,
) -> crate::loadbalancer::task::LanLink {
    use crate::membership::transport::{self, LanView, Want};
    let want = Arc::new(
        watch::channel(Want {
            node: cfg.node_name.clone(),
            port: cfg.lb_membership_port,
            lifetime: cfg.lb_address_lifetime,
            ..Want::default()
        })
        .0,
    );
    let (view_tx, view) = watch::channel(LanView::default());
    let (stop, stop_rx) = watch::channel(None);
    if cfg.lb_membership_port == 0 {
        view_tx.send_replace(LanView {
            why_not: Some("off (lb_membership_port = 0)".into()),
            ..LanView::default()
        });
        return crate::loadbalancer::task::LanLink { want, view, stop };
    }
    tasks.spawn(transport::run(want.subscribe(), view_tx, stop_rx));
    let mut stopping = shutdown.clone();
    let key = follow_membership_key(client, cfg.namespace.clone(), want.clone());
    tasks.spawn(async move {
        tokio::select! {
            _ = key => {}
            _ = stopping.changed() => {}
        }
    });
    let uplink = cfg.uplink.clone();
    let poll = want.clone();
    let mut stopping = shutdown;
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(UPLINK_ADDRESS_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The uplink as the LoadBalancer task picks it (`current_uplink`:
        // kept through a moment without a default route).
        let mut last: Option<String> = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stopping.changed() => return,
            }
            let interface = hna_dhcp::link::current_uplink(
                uplink.as_deref(),
                std::fs::read_to_string(hna_dhcp::link::ROUTE_TABLE)
                    .ok()
                    .as_deref()
                    .and_then(hna_dhcp::link::default_route_interface),
                last.as_deref(),
                |name| std::path::Path::new("/sys/class/net").join(name).exists(),
            );
            last.clone_from(&interface);
            let listen = interface
                .as_deref()
                .and_then(hna_dhcp::link::interface_ipv4);
            poll.send_if_modified(|w| {
                let changed = w.listen != listen;
                w.listen = listen;
                changed
            });
        }
    });
    crate::loadbalancer::task::LanLink { want, view, stop }
}

/// Keeps the membership's keys at what the Secret holds, with whichever
/// client the daemon has.
async fn follow_membership_key(
    mut client: watch::Receiver<Option<kube::Client>>,
    namespace: String,
    want: Arc<watch::Sender<crate::membership::transport::Want>>,
) {
    use crate::membership::transport::KeyBytes;
    use hna_contract::membership::{SECRET_KEY, SECRET_NAME};
    use hna_edges::cluster::watch_one::{Update, watch_one};
    use k8s_openapi::api::core::v1::Secret;
    loop {
        let current = client.borrow_and_update().clone();
        let Some(c) = current else {
            if client.changed().await.is_err() {
                return;
            }
            continue;
        };
        let (tx, mut rx) = mpsc::channel(4);
        let api: kube::Api<Secret> = kube::Api::namespaced(c, &namespace);
        let task = tokio::spawn(watch_one(
            api,
            SECRET_NAME.to_string(),
            hna_edges::cluster::credentials::WATCH_TIMEOUT_SECS,
            tx,
            |u| u,
        ));
        let mut logged = None::<String>;
        loop {
            tokio::select! {
                changed = client.changed() => {
                    task.abort();
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
                u = rx.recv() => {
                    let Some(u) = u else {
                        task.abort();
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        break;
                    };
                    let keys = match u {
                        Update::Present(secret) => {
                            let bytes = secret
                                .data
                                .as_ref()
                                .and_then(|d| d.get(SECRET_KEY))
                                .map(|b| b.0.clone())
                                .unwrap_or_default();
                            if bytes.len() < 32 {
                                let why = format!("the Secret {namespace}/{SECRET_NAME} has no `{SECRET_KEY}` of at least 32 bytes; the controller makes it");
                                if logged.as_deref() != Some(&why) {
                                    tracing::warn!("{why}");
                                    logged = Some(why);
                                }
                                continue;
                            }
                            vec![KeyBytes { id: 1, secret: bytes }]
                        }
                        Update::Absent => {
                            let why = format!("the Secret {namespace}/{SECRET_NAME} does not exist yet (the controller makes it); the LAN membership waits for it");
                            if logged.as_deref() != Some(&why) {
                                tracing::info!("{why}");
                                logged = Some(why);
                            }
                            continue;
                        }
                        // Unreadable: the key known stays.
                        Update::Failed(_) => continue,
                    };
                    logged = None;
                    want.send_if_modified(|w| {
                        let changed = w.keys != keys;
                        w.keys.clone_from(&keys);
                        changed
                    });
                }
            }
        }
    }
}

/// The DHCP engine that will hold this node's LoadBalancer addresses. The
/// macvlans an earlier run left stay for now: the LoadBalancer task adopts
/// the assigned ones and removes the rest once it has read the assignments
/// (see `agent::lb`).
async fn start_dhcp(
    cfg: &Config,
    metrics: Option<&tokio::net::TcpListener>,
    observe: &metrics::AgentMetrics,
) -> anyhow::Result<(Arc<hna_dhcp::engine::Engine>, daemon_state::DhcpStatus)> {
    let store =
        hna_dhcp::store::Store::open(&cfg.state_dir).context("opening the DHCP lease directory")?;
    let engine = Arc::new(
        hna_dhcp::engine::Engine::new(Some(store))
            .context("connecting to rtnetlink for the DHCP engine")?
            .tuning_ipv4()
            .on_acquired(crate::loadbalancer::lease_metrics::observe_acquisitions(
                observe.acquisitions.clone(),
            )),
    );
    // What start-up decided; each snapshot adds the live lease table.
    let at_start = daemon_state::DhcpStatus {
        metrics_url: metrics
            .and_then(|l| l.local_addr().ok())
            .map(|a| format!("http://{a}/metrics")),
        removed_at_start: Vec::new(),
        sweep_problems: Vec::new(),
        leases: Vec::new(),
    };
    Ok((engine, at_start))
}

/// The guest-agent watch, after the first assessment if that outlived the
/// start-up budget.
async fn watch_guest_agent(
    ctx: Context,
    bus: Option<Option<guest::units::Systemd>>,
    pending: Option<GuestSetup>,
    out: watch::Sender<GuestAgentState>,
) {
    let hb = ctx.liveness.register("guest-agent");
    let bus = match (bus, pending) {
        (Some(bus), _) => bus,
        (None, Some(task)) => match systemd::beating(&hb, ctx.beat_every, task).await {
            Ok((bus, state)) => {
                out.send_replace(state);
                bus
            }
            Err(_) => None,
        },
        (None, None) => None,
    };
    guest::watch::run(
        PathBuf::from("/"),
        bus,
        out,
        hb,
        ctx.beat_every,
        ctx.shutdown.clone(),
    )
    .await
}

async fn serve_control(ctx: Context, listener: tokio::net::UnixListener, snapshot: Snapshot) {
    let hb = ctx.liveness.register("control-socket");
    let mut shutdown = ctx.shutdown.clone();
    let mut tick = tokio::time::interval(ctx.beat_every);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let snapshot = snapshot.clone();
                    tokio::spawn(control::serve_connection(stream, move || snapshot.take()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "control socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = tick.tick() => hb.beat(),
            _ = shutdown.changed() => return,
        }
    }
}

async fn serve_metrics(ctx: Context, listener: tokio::net::TcpListener, snapshot: Snapshot) {
    let (liveness, every) = (ctx.liveness.clone(), ctx.beat_every);
    // The watchdog's rule: every main loop beat within a few periods.
    let health: Arc<dyn Fn() -> Result<(), String> + Send + Sync> = Arc::new(
        move || match liveness.stalled(tokio::time::Instant::now(), every * 5) {
            stalled if stalled.is_empty() => Ok(()),
            stalled => Err(format!("main loops stalled: {}", stalled.join(", "))),
        },
    );
    let registry = ctx.metrics.registry(Arc::new(move || snapshot.take()));
    let pages = hna_edges::metrics::Pages {
        metrics: Arc::new(move || hna_edges::metrics::exposition::encode(&registry)),
        live: health.clone(),
        health,
    };
    let mut shutdown = ctx.shutdown.clone();
    tokio::select! {
        _ = hna_edges::metrics::serve(listener, pages) => {}
        _ = shutdown.changed() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::{Instant, sleep};

    #[tokio::test(start_paused = true)]
    async fn work_past_the_budget_is_handed_on_not_awaited() {
        let start = Instant::now();
        let slow = tokio::spawn(async {
            sleep(Duration::from_secs(45)).await;
            7
        });
        let (got, pending) = within(start + READY_BUDGET, slow).await;
        assert_eq!(got, None);
        assert_eq!(start.elapsed(), READY_BUDGET, "READY waits no longer");
        assert_eq!(pending.expect("still running").await.unwrap(), 7);

        let start = Instant::now();
        let fast = tokio::spawn(async {
            sleep(Duration::from_secs(1)).await;
            3
        });
        let (got, pending) = within(start + READY_BUDGET, fast).await;
        assert_eq!((got, pending.is_none()), (Some(3), true));
        assert_eq!(start.elapsed(), Duration::from_secs(1));
    }

    /// The result of a preflight that outlived the budget replaces the
    /// `Checking` state as soon as it is there.
    #[tokio::test(start_paused = true)]
    async fn a_late_preflight_is_published_when_it_ends() {
        let (_stop, shutdown) = watch::channel(false);
        let ctx = Context {
            node: "n".into(),
            beat_every: Duration::from_secs(1),
            liveness: Liveness::default(),
            shutdown,
            metrics: metrics::AgentMetrics::default(),
        };
        let late = tokio::spawn(async {
            sleep(Duration::from_secs(40)).await;
            MacvlanState {
                ready: true,
                reason: crate::kmod::Reason::LoadedByAgent,
                ..MacvlanState::checking(String::new())
            }
        });
        let (tx, mut rx) = watch::channel(MacvlanState::checking("slow".into()));
        let (_req_tx, req_rx) = mpsc::channel(1);
        let start = Instant::now();
        tokio::spawn(macvlan::recheck(
            ctx,
            Duration::from_secs(3600),
            Some(late),
            tx,
            req_rx,
        ));
        rx.changed().await.unwrap();
        assert_eq!(rx.borrow().reason, crate::kmod::Reason::LoadedByAgent);
        assert_eq!(start.elapsed(), Duration::from_secs(40));
    }

    /// The budget is what keeps systemd from killing a slow start: it must
    /// stay well below the shipped unit's start timeout.
    #[test]
    fn the_budget_fits_the_units_start_timeout() {
        let unit = include_str!("../../../../systemd/harvester-node-agent.service");
        let timeout = unit
            .lines()
            .find_map(|l| l.strip_prefix("TimeoutStartSec="))
            .expect("the unit sets TimeoutStartSec");
        let timeout = hna_edges::duration::parse_duration(timeout.trim())
            .expect("TimeoutStartSec is a duration");
        assert!(
            READY_BUDGET * 2 <= timeout,
            "READY_BUDGET {READY_BUDGET:?} must leave half of TimeoutStartSec {timeout:?} as margin"
        );
    }
}
