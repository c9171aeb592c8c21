//! `harvester-node-agent run`: orchestration of the node daemon.
//!
//! Start-up order matters to systemd: configuration is validated before this
//! module is entered; here the state directory and control socket are set up,
//! then `READY=1` is sent. The cluster connection is not part of readiness:
//! the daemon must do its local work on a node that has not joined yet.

pub mod status;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::config::Config;
use crate::control;
use crate::credentials::{self, Discovery, HostEnv};
use crate::guest::{self, GuestAgentState};
use crate::kmod::{self, MacvlanState};
use crate::node_status::{self, Condition, Reported};
use crate::systemd::{self, Heartbeat, Liveness, Notifier};
use status::{AgentStatus, ClusterState, StateDirStatus};

/// The longest a macvlan preflight (modprobe + probe) may take.
const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one API health request may take before the cluster counts as
/// unreachable.
const API_TIMEOUT: Duration = Duration::from_secs(10);

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
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    let mut sighup = signal(SignalKind::hangup()).context("installing SIGHUP handler")?;

    // Binding changes nothing on the host, so a taken port stops start-up
    // before the state directory or any link is touched.
    let metrics_listener = match cfg.metrics_listen {
        Some(addr) => Some(crate::metrics::bind(addr).await.with_context(|| {
            format!(
                "metrics_listen {addr}: cannot listen there; choose a free port or leave metrics_listen unset"
            )
        })?),
        None => None,
    };

    crate::state_dir::prepare(&cfg.state_dir)?;
    let state_dir = StateDirStatus {
        path: cfg.state_dir.clone(),
        ok: true,
        message: "writable".into(),
    };
    let listener = control::bind(&cfg.socket).await?;

    // The DHCP engine that will hold this node's LoadBalancer addresses.
    // Macvlans a crashed run left behind go first: the controller may have
    // moved their addresses to another node meanwhile.
    let store = crate::dhcp::store::Store::open(&cfg.state_dir)
        .context("opening the DHCP lease directory")?;
    let engine = Arc::new(
        crate::dhcp::engine::Engine::new(Some(store))
            .context("connecting to rtnetlink for the DHCP engine")?,
    );
    let (removed_at_start, sweep_problems) = engine.remove_leftovers().await;
    if !removed_at_start.is_empty() {
        tracing::warn!(
            links = ?removed_at_start,
            "removed macvlans an earlier run left behind (not released; lease files kept)"
        );
    }
    for problem in &sweep_problems {
        tracing::warn!(%problem, "could not check a stored DHCP lease for a left-behind macvlan");
    }
    // What start-up decided; each snapshot adds the live lease table.
    let dhcp_at_start = status::DhcpStatus {
        metrics_url: metrics_listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| format!("http://{a}/metrics")),
        removed_at_start,
        sweep_problems,
        leases: Vec::new(),
    };

    // macvlan is local initialisation: its state is known at READY=1. A
    // node without it keeps running (health reporting still matters).
    let macvlan_initial = run_preflight().await;
    log_macvlan(&macvlan_initial);
    let (macvlan_tx, macvlan_rx) = watch::channel(macvlan_initial);
    // One system-bus connection serves the first assessment and the watch.
    let systemd = guest::watch::connect_systemd().await;
    let (guest_tx, guest_rx) = watch::channel(
        guest::watch::assess_with(std::path::Path::new("/"), systemd.as_ref()).await,
    );
    let (client_tx, client_rx) = watch::channel::<Option<kube::Client>>(None);
    let (conditions_tx, conditions_rx) = watch::channel(Reported::NotConnected);
    let topology_cfg = crate::topology::TopologyConfig::from_config(&cfg);
    let (topology_tx, topology_rx) = watch::channel(topology_cfg.initial_state());
    let (recheck_tx, recheck_rx) = tokio::sync::mpsc::channel::<()>(1);

    let (cluster_tx, cluster_rx) = watch::channel(initial_cluster_state(&cfg));
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let liveness = Liveness::default();

    let snapshot = {
        let cluster_rx = cluster_rx.clone();
        let macvlan_rx = macvlan_rx.clone();
        let guest_rx = guest_rx.clone();
        let topology_rx = topology_rx.clone();
        let conditions_rx = conditions_rx.clone();
        let node = cfg.node_name.clone();
        let state_dir = state_dir.clone();
        let engine = engine.clone();
        move || {
            let cluster = cluster_rx.borrow().clone();
            let macvlan = macvlan_rx.borrow().clone();
            let guest_agent = guest_rx.borrow().clone();
            AgentStatus {
                version: env!("CARGO_PKG_VERSION").to_string(),
                pid: std::process::id(),
                node_name: node.clone(),
                started_at: humantime::format_rfc3339_seconds(started).to_string(),
                uptime_seconds: started.elapsed().map(|d| d.as_secs()).unwrap_or(0),
                summary: format!(
                    "{}; topology {}",
                    status::summary(&node, &state_dir, &cluster, &macvlan, &guest_agent),
                    topology_rx.borrow().short()
                ),
                state_dir: state_dir.clone(),
                cluster,
                macvlan,
                guest_agent,
                topology: topology_rx.borrow().clone(),
                node_conditions: conditions_rx.borrow().clone(),
                dhcp: status::DhcpStatus {
                    leases: engine.snapshot(),
                    ..dhcp_at_start.clone()
                },
            }
        }
    };

    let mut tasks = tokio::task::JoinSet::new();
    if let Some(l) = metrics_listener {
        let (metrics_snapshot, liveness, every) = (snapshot.clone(), liveness.clone(), beat_every);
        let mut shutdown = shutdown_rx.clone();
        let pages = crate::metrics::Pages {
            metrics: Arc::new(move || status::metrics(&metrics_snapshot())),
            // The watchdog's rule: every main loop beat within a few periods.
            health: Arc::new(move || {
                match liveness.stalled(tokio::time::Instant::now(), every * 5) {
                    stalled if stalled.is_empty() => Ok(()),
                    stalled => Err(format!("main loops stalled: {}", stalled.join(", "))),
                }
            }),
        };
        tasks.spawn(async move {
            tokio::select! {
                _ = crate::metrics::serve(l, pages) => {}
                _ = shutdown.changed() => {}
            }
        });
    }
    tasks.spawn(serve_control(
        listener,
        snapshot.clone(),
        liveness.register("control-socket"),
        beat_every,
        shutdown_rx.clone(),
    ));
    tasks.spawn(watch_credentials(
        cfg.clone(),
        cluster_tx,
        client_tx,
        liveness.register("credentials"),
        beat_every,
        shutdown_rx.clone(),
    ));
    tasks.spawn(recheck_macvlan(
        cfg.macvlan_recheck,
        macvlan_tx,
        recheck_rx,
        liveness.register("macvlan"),
        beat_every,
        shutdown_rx.clone(),
    ));
    tasks.spawn(guest::watch::run(
        std::path::PathBuf::from("/"),
        systemd,
        guest_tx,
        liveness.register("guest-agent"),
        beat_every,
        shutdown_rx.clone(),
    ));
    tasks.spawn(crate::topology::run(
        topology_cfg,
        client_rx.clone(),
        cfg.node_name.clone(),
        topology_tx,
        shutdown_rx.clone(),
    ));
    tasks.spawn(report_conditions(
        cfg.node_name.clone(),
        cfg.credentials_retry,
        client_rx,
        macvlan_rx.clone(),
        guest_rx.clone(),
        conditions_tx,
        shutdown_rx.clone(),
    ));
    // READY=1 first, then the first STATUS=, then watchdog pings: the order
    // a service manager (and a reader of `systemctl status`) expects.
    notifier.ready();
    tracing::info!(summary = %snapshot().summary, "ready");
    tasks.spawn(publish_status(
        notifier.clone(),
        cluster_rx.clone(),
        macvlan_rx.clone(),
        guest_rx.clone(),
        topology_rx.clone(),
        snapshot.clone(),
        shutdown_rx.clone(),
    ));
    if let Some(period) = watchdog {
        tasks.spawn(systemd::run_watchdog(
            notifier.clone(),
            liveness.clone(),
            period,
            shutdown_rx.clone(),
        ));
    }

    let main_beat = liveness.register("main");
    let mut tick = tokio::time::interval(beat_every);
    let signal_name = loop {
        tokio::select! {
            _ = sigterm.recv() => break "SIGTERM",
            _ = sigint.recv() => break "SIGINT",
            _ = sighup.recv() => {
                tracing::info!("SIGHUP: re-running the macvlan preflight");
                // A full queue means a re-check is already pending.
                let _ = recheck_tx.try_send(());
            }
            _ = tick.tick() => main_beat.beat(),
        }
    };

    tracing::info!(signal = signal_name, "stopping");
    notifier.stopping();
    notifier.status(&format!("stopping ({signal_name})"));
    let _ = shutdown_tx.send(true);
    // Stopping the daemon is a handover, never a release: after a restart
    // or on another node the same address must stay the holder's.
    for e in engine.stop_all(crate::dhcp::StopMode::Handover).await {
        tracing::warn!(error = %e, "could not stop a DHCP lease cleanly");
    }
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(10), drain)
        .await
        .is_err()
    {
        tracing::warn!("some tasks did not stop within 10s; exiting anyway");
    }
    let _ = std::fs::remove_file(&cfg.socket);
    tracing::info!("stopped");
    Ok(())
}

fn initial_cluster_state(cfg: &Config) -> ClusterState {
    match credentials::discover(cfg, &HostEnv) {
        Discovery::NotFound {
            searched,
            configured,
        } => ClusterState::WaitingForCredentials {
            searched,
            configured,
        },
        Discovery::File { path, .. } => ClusterState::Connecting {
            kubeconfig: Some(path),
        },
        Discovery::InCluster => ClusterState::Connecting { kubeconfig: None },
    }
}

/// Drives `fut` to completion while beating, so a loop waiting on bounded
/// network I/O still counts as alive.
async fn beating<F: Future>(hb: &Heartbeat, every: Duration, fut: F) -> F::Output {
    tokio::pin!(fut);
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            out = &mut fut => return out,
            _ = tick.tick() => hb.beat(),
        }
    }
}

async fn serve_control(
    listener: tokio::net::UnixListener,
    snapshot: impl Fn() -> AgentStatus + Clone + Send + 'static,
    hb: Heartbeat,
    beat_every: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(beat_every);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let snapshot = snapshot.clone();
                    tokio::spawn(control::serve_connection(stream, snapshot));
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

/// Finds credentials, connects, and keeps checking the API server. Picks up a
/// kubeconfig that appears (node joins) or changes (credentials rotated).
async fn watch_credentials(
    cfg: Config,
    cluster: watch::Sender<ClusterState>,
    client_out: watch::Sender<Option<kube::Client>>,
    hb: Heartbeat,
    beat_every: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut connected: Option<(Discovery, Option<SystemTime>, kube::Client, String)> = None;
    let mut tick = tokio::time::interval(cfg.credentials_retry);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut beat = tokio::time::interval(beat_every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = beat.tick() => { hb.beat(); continue; }
            _ = shutdown.changed() => return,
        }
        hb.beat();
        let found = credentials::discover(&cfg, &HostEnv);
        let kubeconfig = match &found {
            Discovery::File { path, .. } => Some(path.clone()),
            _ => None,
        };
        let mtime = kubeconfig.as_ref().and_then(|p| modified(p));
        let next = match (&found, &connected) {
            (
                Discovery::NotFound {
                    searched,
                    configured,
                },
                _,
            ) => {
                connected = None;
                ClusterState::WaitingForCredentials {
                    searched: searched.clone(),
                    configured: *configured,
                }
            }
            (_, Some((was, was_mtime, client, server))) if *was == found && *was_mtime == mtime => {
                let (client, server) = (client.clone(), server.clone());
                match beating(
                    &hb,
                    beat_every,
                    tokio::time::timeout(API_TIMEOUT, client.apiserver_version()),
                )
                .await
                {
                    Ok(Ok(info)) => ClusterState::Connected {
                        kubeconfig: kubeconfig.clone(),
                        server,
                        server_version: info.git_version,
                    },
                    Ok(Err(e)) => ClusterState::Unreachable {
                        kubeconfig: kubeconfig.clone(),
                        error: e.to_string(),
                    },
                    Err(_) => ClusterState::Unreachable {
                        kubeconfig: kubeconfig.clone(),
                        error: format!(
                            "API server did not answer within {}",
                            humantime::format_duration(API_TIMEOUT)
                        ),
                    },
                }
            }
            _ => match beating(&hb, beat_every, credentials::connect(&found, API_TIMEOUT)).await {
                Ok(conn) => {
                    tracing::info!(server = %conn.server, version = %conn.server_version, kubeconfig = ?kubeconfig, "connected to the guest cluster");
                    connected = Some((found.clone(), mtime, conn.client, conn.server.clone()));
                    ClusterState::Connected {
                        kubeconfig: kubeconfig.clone(),
                        server: conn.server,
                        server_version: conn.server_version,
                    }
                }
                Err(e) => {
                    connected = None;
                    ClusterState::Unreachable {
                        kubeconfig: kubeconfig.clone(),
                        error: format!("{e:#}"),
                    }
                }
            },
        };
        let usable = match &next {
            ClusterState::Connected { .. } => connected.as_ref().map(|c| c.2.clone()),
            _ => None,
        };
        client_out.send_if_modified(|current| {
            let changed = current.is_some() != usable.is_some();
            *current = usable;
            changed
        });
        cluster.send_if_modified(|current| {
            if *current != next {
                *current = next;
                true
            } else {
                false
            }
        });
    }
}

fn modified(path: &std::path::Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Keeps `STATUS=` and the log in step with the state.
async fn publish_status(
    notifier: Arc<dyn Notifier>,
    mut cluster: watch::Receiver<ClusterState>,
    mut macvlan: watch::Receiver<MacvlanState>,
    mut guest: watch::Receiver<GuestAgentState>,
    mut topology: watch::Receiver<crate::topology::TopologyState>,
    snapshot: impl Fn() -> AgentStatus,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last = String::new();
    loop {
        let summary = snapshot().summary;
        if summary != last {
            notifier.status(&summary);
            match &*cluster.borrow() {
                ClusterState::Unreachable { error, .. } => {
                    tracing::warn!(%error, "{summary}")
                }
                _ => tracing::info!("{summary}"),
            }
            last = summary;
        }
        tokio::select! {
            changed = cluster.changed() => if changed.is_err() { return },
            changed = macvlan.changed() => if changed.is_err() { return },
            changed = guest.changed() => if changed.is_err() { return },
            changed = topology.changed() => if changed.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}

async fn run_preflight() -> MacvlanState {
    let work = tokio::task::spawn_blocking(|| kmod::preflight(&kmod::host::Host::default(), true));
    match tokio::time::timeout(PREFLIGHT_TIMEOUT, work).await {
        Ok(Ok(state)) => state,
        Ok(Err(e)) => failed_preflight(format!("the preflight task failed: {e}")),
        Err(_) => failed_preflight(format!(
            "the preflight did not finish within {}s",
            PREFLIGHT_TIMEOUT.as_secs()
        )),
    }
}

fn failed_preflight(message: String) -> MacvlanState {
    MacvlanState {
        status: crate::check::Status::Fail,
        reason: kmod::Reason::ProbeFailed,
        message,
        remediation: "see the daemon's log; `harvester-node-agent check --fix` runs the same steps"
            .into(),
        ready: false,
        kernel: String::new(),
        loaded_at_boot: None,
    }
}

fn log_macvlan(state: &MacvlanState) {
    if state.ready {
        tracing::info!(reason = state.reason.as_str(), "{}", state.message);
    } else {
        tracing::error!(
            reason = state.reason.as_str(),
            remediation = %state.remediation,
            "macvlan is not usable, DHCP LoadBalancer addresses cannot be held on this node: {}",
            state.message
        );
    }
}

/// Re-runs the preflight on a slow timer and when asked (SIGHUP), so
/// installing the module and reloading fixes a node without a restart.
async fn recheck_macvlan(
    every: Duration,
    state: watch::Sender<MacvlanState>,
    mut requests: tokio::sync::mpsc::Receiver<()>,
    hb: Heartbeat,
    beat_every: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    let mut beat = tokio::time::interval(beat_every);
    loop {
        tokio::select! {
            _ = timer.tick() => {}
            Some(()) = requests.recv() => {}
            _ = beat.tick() => { hb.beat(); continue; }
            _ = shutdown.changed() => return,
        }
        let next = beating(&hb, beat_every, run_preflight()).await;
        let was = state.borrow().clone();
        if was.reason != next.reason || was.ready != next.ready {
            log_macvlan(&next);
        }
        // LoadedByAgent stays the reason while the module stays loaded: who
        // loaded it does not change on a later check.
        let next =
            if was.reason == kmod::Reason::LoadedByAgent && next.reason == kmod::Reason::Loaded {
                MacvlanState {
                    reason: kmod::Reason::LoadedByAgent,
                    ..next
                }
            } else {
                next
            };
        state.send_if_modified(|cur| {
            let changed = *cur != next;
            *cur = next;
            changed
        });
    }
}

fn condition(
    type_: &str,
    ready: bool,
    reason: &str,
    message: &str,
    remediation: &str,
) -> Condition {
    Condition {
        type_: type_.into(),
        ready,
        reason: reason.into(),
        message: if remediation.is_empty() {
            message.to_string()
        } else {
            format!("{message} Fix: {remediation}")
        },
    }
}

fn conditions_from(macvlan: &MacvlanState, guest: &GuestAgentState) -> Vec<Condition> {
    vec![
        condition(
            "MacvlanReady",
            macvlan.ready,
            macvlan.reason.as_str(),
            &macvlan.message,
            &macvlan.remediation,
        ),
        condition(
            "GuestAgentReady",
            guest.ready,
            guest.reason.as_str(),
            &guest.message,
            &guest.remediation,
        ),
    ]
}

/// Keeps the agent's own conditions on its Node: on every change, and every
/// [`node_status::HEARTBEAT`]; retries after `retry` when the Node is not
/// there yet or the write failed.
async fn report_conditions(
    node: String,
    retry: Duration,
    mut client: watch::Receiver<Option<kube::Client>>,
    mut macvlan: watch::Receiver<MacvlanState>,
    mut guest: watch::Receiver<GuestAgentState>,
    out: watch::Sender<Reported>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last_sent: Option<(Vec<Condition>, tokio::time::Instant)> = None;
    loop {
        let current_client = client.borrow().clone();
        let wanted = conditions_from(&macvlan.borrow(), &guest.borrow());
        let mut wait = node_status::HEARTBEAT;
        let result = match current_client {
            None => {
                last_sent = None;
                Reported::NotConnected
            }
            Some(c) => {
                let heartbeat_due = match &last_sent {
                    Some((sent, at)) => *sent != wanted || at.elapsed() >= node_status::HEARTBEAT,
                    None => true,
                };
                let r = node_status::reconcile(&c, &node, &wanted, heartbeat_due).await;
                match &r {
                    Reported::Reported { .. } => {
                        if heartbeat_due {
                            last_sent = Some((wanted.clone(), tokio::time::Instant::now()));
                        }
                    }
                    Reported::Failed { error } => {
                        tracing::warn!(%error, "could not report Node conditions");
                        wait = retry;
                    }
                    _ => wait = retry,
                }
                r
            }
        };
        out.send_if_modified(|cur| {
            let changed = std::mem::discriminant(cur) != std::mem::discriminant(&result);
            *cur = result;
            changed
        });
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            r = client.changed() => if r.is_err() { return },
            r = macvlan.changed() => if r.is_err() { return },
            r = guest.changed() => if r.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}
