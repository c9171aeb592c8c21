//! `harvester-node-agent run`: orchestration of the node daemon.
//!
//! Start-up order matters to systemd: configuration is validated before this
//! module is entered; here the state directory and control socket are set up,
//! then `READY=1` is sent. The cluster connection is not part of readiness:
//! the daemon must do its local work on a node that has not joined yet.
//!
//! One task per subsystem, sharing a small `Context`:
//! - `macvlan`: the preflight and its re-checks;
//! - the guest-agent watch ([`crate::guest::watch`]);
//! - the credentials watcher ([`hna_edges::cluster::connection`]);
//! - the topology relay ([`crate::topology`]);
//! - `conditions`: this node's Node conditions;
//! - `crate::loadbalancer::spawn`: the LoadBalancer addresses this node's `LoadBalancerNode`
//!   assigns, held through the DHCP engine, and that object's status;
//! - `publish`: the `STATUS=` line;
//! - the control socket and the optional metrics endpoint.

mod conditions;
pub mod daemon_state;
mod macvlan;
pub(crate) mod metrics;
mod publish;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

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
pub(crate) const READY_BUDGET: Duration = Duration::from_secs(20);

/// How long one API health request may take before the cluster counts as
/// unreachable.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the daemon could not start: each start-up step that can fail, with
/// its cause kept as the source (the binary prints the chain).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("installing {signal} handler")]
    Signal {
        signal: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "metrics_listen {addr}: cannot listen there; choose a free port or leave metrics_listen unset"
    )]
    MetricsListen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    StateDir(#[from] crate::state_dir::StateDirError),
    #[error(transparent)]
    Control(#[from] control::ControlError),
    #[error("opening the DHCP lease directory")]
    LeaseStore(#[source] hna_dhcp::store::StoreError),
    #[error("connecting to rtnetlink for the DHCP engine")]
    DhcpEngine(#[source] hna_dhcp::engine::EngineError),
}

/// What every task of the daemon shares.
#[derive(Clone)]
pub(crate) struct Context {
    pub(crate) node: String,
    /// How often a task beats while it waits.
    pub(crate) beat_every: Duration,
    pub(crate) liveness: Liveness,
    /// Changes once, when the daemon stops.
    pub(crate) shutdown: watch::Receiver<bool>,
    /// The histograms the tasks observe into.
    pub(crate) metrics: metrics::AgentMetrics,
}

/// Runs until SIGTERM or SIGINT.
pub async fn run(cfg: Config, notifier: Arc<dyn Notifier>) -> Result<(), AgentError> {
    let started = SystemTime::now();
    let watchdog = systemd::watchdog_period();
    let beat_every = systemd::heartbeat_interval(watchdog);
    log_starting(&cfg, watchdog);
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
    let engine = start.engine.clone();
    let mut tasks = tokio::task::JoinSet::new();
    let running = spawn_subsystems(&mut tasks, &ctx, &cfg, start, started);
    // READY=1 first, then the first STATUS=, then watchdog pings: the order
    // a service manager (and a reader of `systemctl status`) expects.
    notifier.ready();
    tracing::info!(summary = %running.snapshot.take().summary, "ready");
    let snapshot = running.snapshot;
    tasks.spawn(publish::status_line(
        notifier.clone(),
        running.sources,
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
        .until_stop(&ctx.liveness.register("main"), beat_every, &running.recheck)
        .await;
    tracing::info!(signal = signal_name, "stopping");
    notifier.stopping();
    notifier.status(&format!("stopping ({signal_name})"));
    let _ = shutdown_tx.send(true);
    shut_down(tasks, &engine).await;
    let _ = std::fs::remove_file(&cfg.socket);
    tracing::info!("stopped");
    Ok(())
}

fn log_starting(cfg: &Config, watchdog: Option<Duration>) {
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        node = %cfg.node_name,
        config = ?cfg.file,
        state_dir = %cfg.state_dir.display(),
        socket = %cfg.socket.display(),
        watchdog = ?watchdog,
        "starting harvester-node-agent"
    );
}

/// What the running subsystems leave for the daemon's own loop.
struct Running {
    snapshot: Snapshot,
    /// What the `STATUS=` line follows.
    sources: publish::Sources,
    /// Asks the macvlan task for a re-check (SIGHUP).
    recheck: mpsc::Sender<()>,
}

/// One task per subsystem (see the module's documentation), wired by the
/// channels they publish on.
fn spawn_subsystems(
    tasks: &mut tokio::task::JoinSet<()>,
    ctx: &Context,
    cfg: &Config,
    start: StartUp,
    started: SystemTime,
) -> Running {
    let settings = cfg.credential_settings();
    let topology_cfg = crate::topology::TopologyConfig::from_config(cfg);
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

    if let Some(l) = start.metrics {
        tasks.spawn(serve_metrics(ctx.clone(), l, snapshot.clone()));
    }
    tasks.spawn(serve_control(ctx.clone(), start.control, snapshot.clone()));
    tasks.spawn(connection::watch(
        WatchOptions {
            settings,
            every: cfg.credentials_retry,
            api_timeout: API_TIMEOUT,
            beat_every: ctx.beat_every,
        },
        HostEnv,
        cluster_tx,
        client_tx,
        ctx.liveness.register("credentials"),
        ctx.shutdown.clone(),
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
        ctx.shutdown.clone(),
    ));
    crate::loadbalancer::spawn::spawn(
        tasks,
        crate::loadbalancer::spawn::Daemon {
            liveness: &ctx.liveness,
            beat_every: ctx.beat_every,
            shutdown: ctx.shutdown.clone(),
            takeover_guard_wait: ctx.metrics.takeover_guard_wait.clone(),
        },
        cfg,
        start.engine,
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
    Running {
        snapshot,
        sources: publish::Sources {
            cluster: cluster_rx,
            macvlan: macvlan_rx,
            guest: guest_rx,
            topology: topology_rx,
            lb: lb_rx,
        },
        recheck: recheck_tx,
    }
}

/// Waits (a while) for the tasks to stop, then hands over what leases
/// still run.
async fn shut_down(mut tasks: tokio::task::JoinSet<()>, engine: &hna_dhcp::engine::Engine) {
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
    for e in engine.stop_all(hna_dhcp::StopMode::Handover).await {
        tracing::warn!(error = %e, "could not stop a DHCP lease cleanly");
    }
}

/// The signals the daemon acts on.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals, AgentError> {
        let one = |kind: SignalKind, name: &'static str| {
            signal(kind).map_err(|source| AgentError::Signal {
                signal: name,
                source,
            })
        };
        Ok(Signals {
            term: one(SignalKind::terminate(), "SIGTERM")?,
            int: one(SignalKind::interrupt(), "SIGINT")?,
            hup: one(SignalKind::hangup(), "SIGHUP")?,
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
async fn start_up(cfg: &Config) -> Result<StartUp, AgentError> {
    let started_at = tokio::time::Instant::now();
    // Binding changes nothing on the host, so a taken port stops start-up
    // before the state directory or any link is touched.
    let metrics = match cfg.metrics_listen {
        Some(addr) => Some(
            hna_edges::metrics::bind(addr)
                .await
                .map_err(|source| AgentError::MetricsListen { addr, source })?,
        ),
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

/// The DHCP engine that will hold this node's LoadBalancer addresses. The
/// macvlans an earlier run left stay for now: the LoadBalancer task adopts
/// the assigned ones and removes the rest once it has read the assignments
/// (see `crate::loadbalancer::task`).
async fn start_dhcp(
    cfg: &Config,
    metrics: Option<&tokio::net::TcpListener>,
    observe: &metrics::AgentMetrics,
) -> Result<(Arc<hna_dhcp::engine::Engine>, daemon_state::DhcpStatus), AgentError> {
    let store = hna_dhcp::store::Store::open(&cfg.state_dir).map_err(AgentError::LeaseStore)?;
    let engine = Arc::new(
        hna_dhcp::engine::Engine::new(Some(store))
            .map_err(AgentError::DhcpEngine)?
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
    // why String: the `/healthz` page's body (`hna_edges::metrics::Pages`).
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
