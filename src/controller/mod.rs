//! `harvester-node-agent controller`: the in-cluster controller.
//!
//! Today it establishes what every reconciler needs — credentials, a
//! verified connection that follows credential changes, systemd readiness
//! and clean shutdown. The load-balancer placement and Service status
//! reconcilers are added by the load-balancer work; until then the
//! controller changes nothing in the cluster.

pub mod election;
pub mod placement;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::cluster::connection::{self, ClusterState, WatchOptions};
use crate::cluster::credentials::{self, HostEnv, Settings};
use crate::systemd::{self, Liveness, Notifier};

/// How long one API health request may take.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// The controller's own settings (its command line is `cli`'s
/// `ControllerArgs`); none of the node daemon's keys apply to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// A kubeconfig to use; `None` means `$KUBECONFIG`, then the Pod's
    /// service account.
    pub kubeconfig: Option<PathBuf>,
    /// How often to look for credentials and re-check the API server.
    pub credentials_retry: Duration,
}

pub async fn run(opts: Options, notifier: Arc<dyn Notifier>) -> anyhow::Result<()> {
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        "starting harvester-node-agent controller"
    );
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    let watchdog = systemd::watchdog_period();
    let beat_every = systemd::heartbeat_interval(watchdog);
    let settings = Settings {
        kubeconfig: opts.kubeconfig.clone(),
        search: Vec::new(),
    };
    let (cluster_tx, mut cluster_rx) = watch::channel(ClusterState::initial(
        &credentials::discover(&settings, &HostEnv),
    ));
    let (client_tx, _client_rx) = watch::channel::<Option<kube::Client>>(None);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let liveness = Liveness::default();
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(connection::watch(
        WatchOptions {
            settings,
            every: opts.credentials_retry,
            api_timeout: API_TIMEOUT,
            beat_every,
        },
        HostEnv,
        cluster_tx,
        client_tx,
        liveness.register("credentials"),
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
    notifier.ready();

    let main_beat = liveness.register("main");
    let mut tick = tokio::time::interval(beat_every);
    let mut last_status = String::new();
    loop {
        let status = summary(&cluster_rx.borrow());
        if status != last_status {
            tracing::info!("{status}");
            notifier.status(&status);
            last_status = status;
        }
        tokio::select! {
            changed = cluster_rx.changed() => if changed.is_err() { break },
            _ = tick.tick() => main_beat.beat(),
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    notifier.stopping();
    let _ = shutdown_tx.send(true);
    let drain = async { while tasks.join_next().await.is_some() {} };
    let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
    tracing::info!("controller stopped");
    Ok(())
}

/// The controller's `STATUS=` line.
pub fn summary(cluster: &ClusterState) -> String {
    match cluster {
        ClusterState::Connected {
            server,
            server_version,
            ..
        } => format!(
            "controller: connected to {server} ({server_version}); no reconcilers enabled yet"
        ),
        ClusterState::Connecting { .. } => "controller: connecting to the cluster".into(),
        ClusterState::Unreachable { error, .. } => {
            format!("controller: cluster unreachable: {error}")
        }
        ClusterState::WaitingForCredentials { searched, .. } => format!(
            "controller: waiting for credentials (searched {})",
            searched
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
